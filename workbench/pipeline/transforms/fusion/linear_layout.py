"""``linear_weight_layout`` (stage ``post_load_fusion``): how CPU linears read their weights.

A decode step is a chain of small-M GEMMs (``x [M, K] @ W.T``, ``W [N, K]``, M = sequences in the
step). ``aten.linear`` hands MKL that product as is, and MKL streams the row-major weight slowly
for small M. Two rewrites, chosen by ``layout``:

* ``wxt``: ``cpu_linear_wxt(x, W, b)`` computes
  ``(W @ x.T).T`` on the weights as loaded -- the orientation in which MKL streams a row-major
  weight fastest at every decode batch size (one row padded to two; ``workbench/ops/mlp/
  cpu_linear_wxt.py`` has the measurements). Nothing is copied. SmolLM2 decode on this project's
  2-core machine, ``torch-compile``: 26.2 -> 35.6 tok/s at batch 1, 92 -> 134 at batch 8 against ``kn``.
* ``kn``: ``matmul(x, W_kn) (+ b)`` with ``W_kn = W.t().contiguous() [K, N]`` transposed once, here,
  for every linear (MKL's GEMV reads a K-major copy faster than the row-major weight when the
  output is at least as wide as the input: GB/s row-major -> K-major, SmolLM2 shapes N x K:
  960 x 576 11.3 -> 16.7, 3072 x 576 11.3 -> 20.2, 49152 x 576 11.5 -> 25.1, but 576 x 1536
  15.9 -> 12.1; it was the CPU default before ``wxt``). The transposed weight is a new parameter beside the original (``<name>_kn``); the
  original is dropped when nothing else reads it, so memory moves by ``new_bytes - freed_bytes``
  (a tied LM head keeps its embedding table: one extra copy).

* ``kernel``: fp32 linears -> ``cpu_linear``, canonical ``torch_int4_linear`` / ``torch_int8_linear`` ->
  ``cpu_int4_linear`` / ``cpu_int8_linear`` (``workbench/ops/cpu_kernels``, this CPU's AVX-512, AVX2 or NEON
  build): one pass over the weights as loaded per 8 rows of input (up to 16 rows; larger inputs go to BLAS). Nothing is
  copied. Quantized linears are rewritten under every layout except ``nk``, which keeps the
  reference ops (dequantize, then ``F.linear``) -- the ground truth the numerics compare against.

``auto`` on CPU takes what this CPU measured fastest (``workbench/ops/cpu_kernels/calibrate.py``: a
short calibration once per machine and kernel build, cached): for fp32 linears ``kernel``, ``wxt``
or ``nk``; quantized linears go to the C++ kernels where they load, with the int4 activations the
calibration picked (``int4_activations: auto``: int8 only where it measured at least 10 % faster).
Where the kernels do not load (no variant for this CPU, no compiler, ``WORKBENCH_CPU_ISA=none``) the
quantized weights are dequantized once, here, to fp32 linears (the reference op would dequantize
them on every call), and the fp32 choice applies to them too. On CUDA cuBLAS reads either layout at
full speed, so ``layout: auto`` leaves the graph alone there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Literal, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from ...context import PipelineContext
from ...graph.weights import LINEAR, fake_value, fetch_attr, linear_bias, param_of, release_weights
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import annotate_new_nodes, inserted_between

aten = torch.ops.aten


class LinearWeightLayoutConfig(TransformConfig):
    layout: Literal["auto", "nk", "kn", "wxt", "kernel"] = Field(
        default="auto",
        description="How linears read their weights: 'nk' (aten.linear on the weight as "
        "loaded, [out, in]), 'kn' (matmul on a transposed copy [in, out]), 'wxt' (the weight as loaded, "
        "computed as (W @ x.T).T by workbench.cpu_linear_wxt), 'kernel' (the workbench's C++ CPU kernels, "
        "fp32 and int4/int8), 'auto' (on CPU what this CPU measured fastest, cached per machine and kernel "
        "build: the C++ kernels for quantized weights where they load, else the weights dequantized once; "
        "kernel, wxt or nk for fp32 ones; nk on other devices).",
    )
    int4_activations: Literal["auto", "fp32", "int8"] = Field(
        default="auto",
        description="What the int4 CPU kernel multiplies the 4-bit weights with in decode "
        "steps (<= 16 rows): 'fp32' (the activations as they are: equal to the reference op up to summation "
        "order), 'int8' (activations rounded to 8 bits per block of 32, scale max|x|/127, and integer "
        "dot products, as llama.cpp does for Q4 weights: a numerics change; AVX512-VNNI, AVX2 or NEON byte "
        "dot products) or 'auto' (int8 where this CPU measured it at least 10 % faster than fp32, else fp32; "
        "the details say which and the times). Prefill inputs are always exact.",
    )
    expect_mem_change: bool = Field(
        default=True, description="Transposed copies replace (or, when tied, add to) the weights."
    )


def transposed_weight(gm: fx.GraphModule, target: str) -> Tuple[str, int]:
    """Register ``<target>_kn = W.t().contiguous()`` beside ``target``; returns (target, bytes)."""
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    w = fetch_attr(gm, target)
    new_name, i = f"{name}_kn", 1
    while hasattr(owner, new_name):
        new_name, i = f"{name}_kn{i}", i + 1
    with torch.no_grad():
        kn = w.detach().t().contiguous()
    owner.register_parameter(new_name, torch.nn.Parameter(kn, requires_grad=False))
    return (f"{owner_path}.{new_name}" if owner_path else new_name), kn.numel() * kn.element_size()


@register("linear_weight_layout")
class LinearWeightLayout(Transform[LinearWeightLayoutConfig]):
    """``linear(x, W, b)`` -> ``cpu_linear_wxt(x, W, b)`` (``wxt``) or ``matmul(x, W.T contiguous) + b``
    (``kn``); see the module docstring."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        from ....ops import cpu_kernels
        from ....ops.cpu_kernels import calibrate

        device = torch.device(ctx.device)
        layout: str = self.config.layout
        act: str = self.config.int4_activations
        auto = layout == "auto"
        if (auto and device.type != "cpu") or layout == "nk":  # nk: the reference ops stay (the ground truth)
            return gm, TransformInfo(num_matches=0, details={"layout": "nk (weights left as loaded)"})
        kernels = device.type == "cpu" and cpu_kernels.is_available(device)[0]
        notes: Dict[str, Any] = {}
        summary = []  # one line for the run's summary (Workbench.backends_line)
        if kernels:
            if act == "auto" and ctx.dist.world_size > 1:
                # Each rank would calibrate on its own (one thread, its own shard, its own noise) and
                # could pick the other rounding: int8 rounding on one rank reaches every rank's logits
                # through the all-reduce, which the cache check of a rank that chose exact does not
                # expect. Sharded runs take the exact activations on every rank.
                act = "fp32"
                notes["int4_activations_auto"] = "fp32 (sharded: every rank the same numerics, not calibrated)"
            elif act == "auto":
                measured = calibrate.int4_activation_choice(_int4_linears(gm)) if _int4_linears(gm) else None
                act = measured.choice if measured is not None else "fp32"
                if measured is not None:
                    notes["int4_activations_auto"] = measured.why()
            quantized = _to_quantized_kernels(gm, device, act)
            if quantized:
                notes["int4_activations"] = "fp32" if act == "fp32" else f"int8 ({cpu_kernels.int8_dot()})"
                how = (
                    f" [auto, {notes['int4_activations_auto'].split(' (', 1)[1][:-1]}]"
                    if "int4_activations_auto" in notes
                    else ""
                )
                exact = "exact fp32 activations" if act == "fp32" else "int8 activations"
                summary.append(f"{quantized} quantized on the C++ kernels, {exact}{how}")
        elif auto and device.type == "cpu":  # no C++ kernels here: the quantized weights once to fp32, not per call
            quantized, nbytes = _dequantize_once(gm)
            if quantized:
                notes["dequantized"] = (
                    f"{quantized} quantized linears dequantized once to fp32 linears (+{nbytes / 2**20:.1f} MiB): "
                    f"no C++ kernels here ({cpu_kernels.load()})"
                )
                summary.append(f"{quantized} quantized dequantized once to fp32 (+{nbytes / 2**20:.0f} MiB)")
        else:
            quantized = 0
        if auto:
            weights = _fp32_linear_weights(gm)
            # every rank of a sharded run takes rank 0's choice (DistInfo.agree)
            measured = ctx.dist.agree(calibrate.fp32_linear_choice(weights)) if weights else None
            layout = measured.choice if measured is not None else "nk"
            if measured is not None:
                notes["auto"] = f"fp32 linears: {measured.why()}"
                summary.append(f"{len(weights)} fp32 as {layout} [auto, {measured.evidence()}]")
        if summary:
            notes["summary"] = "; ".join(summary)
        if layout in ("kernel", "wxt", "nk"):
            if layout == "kernel":
                gm, info = _to_kernels(gm, device)
            elif layout == "wxt":
                gm, info = _to_wxt(gm, fp32_only=auto)
            else:  # auto measured aten.linear fastest for fp32 weights (or there are none): they stay
                info = TransformInfo(
                    num_matches=0,
                    is_clean=True,
                    has_valid_shapes=True,
                    details={"layout": "nk (weights left as loaded)"},
                )
            # the quantized linears were retargeted or rewritten with their values: shapes stay valid
            info.num_matches += quantized
            info.is_clean = info.is_clean and not quantized
            info.details.update(notes)
            return gm, info
        done: Dict[str, str] = {}  # original weight target -> transposed target (shared weights once)
        new_bytes = 0

        def matmul_kn(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
            nonlocal new_bytes
            target = node.args[1].target
            if target not in done:
                done[target], nbytes = transposed_weight(gm, target)
                new_bytes += nbytes
            w_kn = g.get_attr(done[target])
            w_kn.meta["val"] = fake_value(gm, fetch_attr(gm, done[target]))
            out = g.call_function(aten.matmul.default, (node.args[0], w_kn))
            return g.call_function(aten.add.Tensor, (out, bias)) if bias is not None else out

        rewritten = _rewrite_linears(gm, matmul_kn) + quantized
        released = release_weights(gm, list(done))
        details = {
            **notes,
            "layout": layout,
            "weights": len(done),
            "new_bytes": new_bytes,
            "freed_bytes": released.freed_bytes,
            "kept_originals": released.kept + released.tied,
        }
        return gm, TransformInfo(
            num_matches=rewritten, is_clean=not rewritten, has_valid_shapes=not rewritten, details=details
        )


def _rewrite_linears(
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


def _to_wxt(gm: fx.GraphModule, fp32_only: bool) -> Tuple[fx.GraphModule, TransformInfo]:
    """Every 2-D-weight ``linear(x, W, b)`` -> ``cpu_linear_wxt(x, W, b)``: no weight is copied.
    ``fp32_only`` (``auto``): the speed-up was measured on MKL's fp32 GEMM; other dtypes stay."""
    import workbench.ops.mlp.cpu_linear_wxt  # noqa: F401  (registers the op)

    op = torch.ops.workbench.cpu_linear_wxt.default

    def wxt(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
        new = g.call_function(op, (node.args[0], node.args[1], bias))
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        return new

    rewritten = _rewrite_linears(gm, wxt, fp32_only)
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


def _to_quantized_kernels(gm: fx.GraphModule, device: torch.device, int4_activations: str = "fp32") -> int:
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


def _fp32_linear_weights(gm: fx.GraphModule) -> list:
    """The 2-D fp32 weights of the graph's ``aten.linear`` nodes, in graph order (each once)."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR:
            w = param_of(gm, node.args[1])
            if w is not None and w.dim() == 2 and w.dtype == torch.float32 and id(w) not in seen:
                seen.add(id(w))
                out.append(w)
    return out


def _int4_linears(gm: fx.GraphModule) -> list:
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


def _dequantize_once(gm: fx.GraphModule) -> Tuple[int, int]:
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


def _to_kernels(gm: fx.GraphModule, device: torch.device) -> Tuple[fx.GraphModule, TransformInfo]:
    """fp32 ``linear(x, W, b)`` -> ``cpu_linear(x, W, b)`` (the quantized linears: ``_to_quantized_kernels``)."""
    _kernels_or_raise(device)
    op = torch.ops.workbench.cpu_linear.default

    def kernel(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
        new = g.call_function(op, (node.args[0], node.args[1], bias))
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        return new

    rewritten = _rewrite_linears(gm, kernel, fp32_only=True)
    return gm, TransformInfo(
        num_matches=rewritten,
        is_clean=not rewritten,
        has_valid_shapes=True,
        details={"layout": "kernel", "new_bytes": 0, "freed_bytes": 0},
    )


__all__ = ["LinearWeightLayout", "LinearWeightLayoutConfig", "transposed_weight"]
