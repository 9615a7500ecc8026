"""The graph rewrites ``linear_weight_layout`` (``linear_layout.py``) chooses between, and the weights
its ``auto`` calibration reads.

* ``to_wxt``: fp32 (or every) 2-D-weight ``linear(x, W, b)`` -> ``cpu_linear_wxt(x, W, b)``;
* ``to_kernels``: fp32 linears -> the C++ ``cpu_linear``;
* ``to_quantized_kernels``: canonical ``torch_int4_linear`` / ``torch_int8_linear`` -> the C++
  ``cpu_int4_linear`` (or ``cpu_int4_linear_a8``) / ``cpu_int8_linear``, same arguments;
* ``dequantize_once``: canonical int4/int8 linears -> ``aten.linear`` on an fp32 copy of the weight,
  dequantized here once by the op's own reference function (where the C++ kernels do not load).

``rewrite_linears`` replaces every ``aten.linear`` with a 2-D parameter weight by what a builder
inserts (the ``kn`` layout uses it too); ``fp32_linear_weights`` and ``int4_linears`` list what the
calibration (``ops/cpu_kernels/calibrate.py``) measures on.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.fx as fx

from ...graph.weights import LINEAR, fake_value, fetch_attr, linear_bias, param_of, release_weights
from ...interface import TransformInfo
from ...matcher import annotate_new_nodes, inserted_between


def rewrite_linears(
    gm: fx.GraphModule, build: Callable[[fx.Graph, fx.Node, Any], fx.Node], fp32_only: bool = False
) -> int:
    """Replace every ``aten.linear`` with a 2-D parameter weight by what ``build(graph, node, bias)``
    inserts before it (``fp32_only``: fp32 weights only); returns how many were replaced."""
    g, rewritten = gm.graph, 0
    for node in [n for n in g.nodes if n.op == "call_function" and n.target is LINEAR]:
        w = param_of(gm, node.args[1])
        if w is None or w.dim() != 2 or (fp32_only and w.dtype != torch.float32):
            continue
        bias = linear_bias(node)

        def rewrite(g: fx.Graph, node: fx.Node = node, bias: Any = bias) -> fx.Node:
            return build(g, node, bias)

        _replace(gm, node, rewrite)
        rewritten += 1
    if rewritten:
        g.lint()
        gm.recompile()
    return rewritten


def _replace(gm: fx.GraphModule, node: fx.Node, build: Callable[[fx.Graph], fx.Node]) -> None:
    """``node`` -> what ``build(graph)`` inserts before it (annotated as coming from it), its uses moved."""
    g, prev = gm.graph, node.prev
    with g.inserting_before(node):
        out = build(g)
    annotate_new_nodes(gm, inserted_between(prev, node), [node.name], anchor=node)
    node.replace_all_uses_with(out)
    g.erase_node(node)


def to_wxt(gm: fx.GraphModule, fp32_only: bool) -> Tuple[fx.GraphModule, TransformInfo]:
    """Every 2-D-weight ``linear(x, W, b)`` -> ``cpu_linear_wxt(x, W, b)``: no weight is copied.
    ``fp32_only`` (``auto``): the speed-up was measured on MKL's fp32 GEMM; other dtypes stay."""
    import workbench.ops.mlp.cpu_linear_wxt  # noqa: F401  (registers the op)

    op = torch.ops.workbench.cpu_linear_wxt.default

    def wxt(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
        new = g.call_function(op, (node.args[0], node.args[1], bias))
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        return new

    rewritten = rewrite_linears(gm, wxt, fp32_only)
    # the replacement carries the linear's value (same shape, contiguous): shapes stay valid
    return gm, TransformInfo(
        num_matches=rewritten,
        is_clean=not rewritten,
        has_valid_shapes=True,
        details={"layout": "wxt", "new_bytes": 0, "freed_bytes": 0},
    )


QUANTIZED_KERNELS = {  # canonical op -> (CPU kernel op name, index of the scale arguments that must be fp16)
    "torch_int4_linear": ("cpu_int4_linear", (2, 3)),
    "torch_int8_linear": ("cpu_int8_linear", (2,)),
}


def _kernels_or_raise(device: torch.device) -> None:
    from ....ops import cpu_kernels

    ok, why = cpu_kernels.is_available(device)
    if not ok:
        raise RuntimeError(f"linear_weight_layout.layout=kernel cannot run here: {why}. Use layout 'wxt' or 'auto'.")


def to_quantized_kernels(gm: fx.GraphModule, device: torch.device, int4_activations: str = "fp32") -> int:
    """Canonical int4/int8 linears -> the C++ kernels (same arguments), when they run here, the
    activations are fp32 and the scales fp16 as the kernels read them; returns how many were rewritten.
    ``int4_activations='int8'``: int4 linears -> ``cpu_int4_linear_a8`` (see the config field)."""
    from ....ops import cpu_kernels

    if device.type != "cpu" or not cpu_kernels.is_available(device)[0]:
        return 0
    import workbench.ops.quant  # noqa: F401  (registers the canonical ops)

    table = {getattr(torch.ops.workbench, canonical).default: row for canonical, row in QUANTIZED_KERNELS.items()}
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in table:
            continue
        kernel, scale_args = table[node.target]
        if kernel == "cpu_int4_linear" and int4_activations == "int8":
            kernel = "cpu_int4_linear_a8"
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if getattr(x, "dtype", None) != torch.float32:
            continue  # e.g. a bfloat16 model: the reference op serves it
        if all(getattr(param_of(gm, node.args[i]), "dtype", None) == torch.float16 for i in scale_args):
            node.target = getattr(torch.ops.workbench, kernel).default
            n += 1
    if n:
        gm.recompile()
    return n


def fp32_linear_weights(gm: fx.GraphModule) -> list:
    """The 2-D fp32 weights of the graph's ``aten.linear`` nodes, in graph order (each once)."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR:
            w = param_of(gm, node.args[1])
            if w is not None and w.dim() == 2 and w.dtype == torch.float32 and id(w) not in seen:
                seen.add(id(w))
                out.append(w)
    return out


def int4_linears(gm: fx.GraphModule) -> list:
    """(qweight, scales, offsets, group_size) of the canonical int4 linears the C++ kernels take (fp32
    activations, fp16 scales), in graph order: what the int4 activations are calibrated on."""
    import workbench.ops.quant  # noqa: F401  (registers the canonical ops)

    op, out = torch.ops.workbench.torch_int4_linear.default, []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        q, s, o = (param_of(gm, node.args[i]) for i in (1, 2, 3))
        if getattr(x, "dtype", None) == torch.float32 and q is not None and s is not None and o is not None:
            if s.dtype == o.dtype == torch.float16 and int(node.args[4]) % 32 == 0:
                out.append((q, s, o, int(node.args[4])))
    return out


# canonical quantized linear -> (positions of the weight tensors, position of group_size)
QUANTIZED_WEIGHTS = {"torch_int4_linear": ((1, 2, 3), 4), "torch_int8_linear": ((1, 2), 3)}


def dequantize_once(gm: fx.GraphModule) -> Tuple[int, int]:
    """Canonical int4/int8 linears with fp32 activations -> ``aten.linear`` on an fp32 copy of the
    weight, dequantized here once by the op's own reference function (so the values are the ones
    the reference computes on every call). The packed tensors go when nothing else reads them (a
    tied int8 embedding keeps its table). Returns (linears rewritten, bytes of the new weights)."""
    import workbench.ops.quant  # noqa: F401  (registers the canonical ops)

    from ....ops.quant import dequantize_int4, dequantize_int8

    dequantize: Dict[str, Callable[..., torch.Tensor]] = {
        "torch_int4_linear": dequantize_int4,
        "torch_int8_linear": dequantize_int8,
    }
    table = {getattr(torch.ops.workbench, name).default: name for name in QUANTIZED_WEIGHTS}
    g, n, new_bytes = gm.graph, 0, 0
    made: Dict[Tuple[str, ...], str] = {}  # the packed tensors' targets -> the fp32 weight's target
    packed: list = []
    for node in [x for x in g.nodes if x.op == "call_function" and x.target in table]:
        name = table[node.target]
        positions, group_at = QUANTIZED_WEIGHTS[name]
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        tensors = [param_of(gm, node.args[i]) for i in positions]
        if getattr(x, "dtype", None) != torch.float32 or any(t is None for t in tensors):
            continue
        key = tuple(node.args[i].target for i in positions)
        if key not in made:
            with torch.no_grad():
                weight = dequantize[name](*tensors, node.args[group_at]).float()
            owner_path, _, base = key[0].rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            attr, i = f"{base}_dequantized", 1
            while hasattr(owner, attr):
                attr, i = f"{base}_dequantized{i}", i + 1
            owner.register_parameter(attr, torch.nn.Parameter(weight, requires_grad=False))
            made[key] = f"{owner_path}.{attr}" if owner_path else attr
            new_bytes += weight.numel() * weight.element_size()
            packed += list(key)
        bias = node.args[group_at + 1] if len(node.args) > group_at + 1 else node.kwargs.get("bias")

        def linear(g: fx.Graph, node: fx.Node = node, target: str = made[key], bias: Any = bias) -> fx.Node:
            w = g.get_attr(target)
            w.meta["val"] = fake_value(gm, fetch_attr(gm, target))
            out = g.call_function(LINEAR, (node.args[0], w, bias))
            out.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            return out

        _replace(gm, node, linear)
        n += 1
    if n:
        g.lint()
        gm.recompile()
        release_weights(gm, packed)
    return n, new_bytes


def to_kernels(gm: fx.GraphModule, device: torch.device) -> Tuple[fx.GraphModule, TransformInfo]:
    """fp32 ``linear(x, W, b)`` -> ``cpu_linear(x, W, b)`` (the quantized linears: ``to_quantized_kernels``)."""
    _kernels_or_raise(device)
    op = torch.ops.workbench.cpu_linear.default

    def kernel(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
        new = g.call_function(op, (node.args[0], node.args[1], bias))
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        return new

    rewritten = rewrite_linears(gm, kernel, fp32_only=True)
    return gm, TransformInfo(
        num_matches=rewritten,
        is_clean=not rewritten,
        has_valid_shapes=True,
        details={"layout": "kernel", "new_bytes": 0, "freed_bytes": 0},
    )


__all__ = [
    "QUANTIZED_KERNELS",
    "QUANTIZED_WEIGHTS",
    "dequantize_once",
    "fp32_linear_weights",
    "int4_linears",
    "rewrite_linears",
    "to_kernels",
    "to_quantized_kernels",
    "to_wxt",
]
