"""Export a stack of identical decoder layers by tracing three of them and stamping the rest.

``torch.export`` spends most of its time tracing the decoder layers one op at a time with symbolic
shapes: ~0.2-0.3 s per layer here, so 30 layers of SmolLM2 are ~7 of its ~9 s. When every layer is
the same module with the same configuration, their ATen graphs are the same graph with other
weights. ``export_to_gm`` (``stamp_repeated_layers``) then exports a twin of the model truncated to
``TRACED`` layers, checks that the traced layers 1 and 2 are node-for-node the same graph (ops,
arguments, wiring), and appends copies of layer 2 for layers 3..N-1, each reading its own weights
(``<layers>.<i>.*``, registered on ``meta`` like export's) and the previous copy's output.

When it applies (all checked, otherwise the whole model is exported as before, with the reason):
* one ``nn.ModuleList`` of ``config.num_hidden_layers`` modules, of one class, with the same
  parameter names/shapes/dtypes and the same plain attributes (``layer_idx`` aside) -- so a
  sliding-window/full mix, a NoPE layer every 4th, or dense layers among MoE ones all refuse;
* no per-layer list in the config (``layer_types``, ...) with differing entries;
* in the traced graph each layer reads the previous one only through one node (the residual
  stream), and layers 1 and 2 are isomorphic.
The numerics probe after ``export_to_gm`` compares the stamped graph with the eager model, and the
tests compare it node for node with a full export on every tiny architecture.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

TRACED = 3  # layers exported: 0 (may differ: it reads the embeddings), 1 and 2 (compared), then copies of 2
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "idx"})


def find_layer_stack(module: torch.nn.Module, num_layers: int) -> Optional[str]:
    """Qualified name of the one ``nn.ModuleList`` holding ``num_layers`` modules, else None."""
    hits = [
        name for name, sub in module.named_modules() if isinstance(sub, torch.nn.ModuleList) and len(sub) == num_layers
    ]
    return hits[0] if len(hits) == 1 else None


def _signature(layer: torch.nn.Module) -> Tuple:
    """What makes two layers the same graph: classes, parameter/buffer shapes and plain attributes."""
    parts = []
    for name, sub in layer.named_modules():
        plain = tuple(
            sorted(
                (k, repr(v))
                for k, v in vars(sub).items()
                if not k.startswith("_")
                and k not in _INDEX_ATTRS
                and k != "training"
                and isinstance(v, (int, float, bool, str, type(None), tuple))
            )
        )
        tensors = tuple(
            (k, tuple(t.shape), t.dtype) for k, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None
        )
        parts.append((name, type(sub).__qualname__, plain, tensors))
    return tuple(parts)


def why_not_stampable(model: torch.nn.Module, config: Any) -> Tuple[Optional[str], Optional[str]]:
    """(reason it cannot be stamped or None, qualified name of the layer stack)."""
    if hasattr(config, "get_text_config"):  # a vision-language config: the decoder stack's own config
        config = config.get_text_config()
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= TRACED:
        return f"{n} layers: nothing to gain over a full trace", None
    path = find_layer_stack(model, n)
    if path is None:
        return f"no single nn.ModuleList of {n} layers found", None
    layers = model.get_submodule(path)
    assert isinstance(layers, torch.nn.ModuleList)  # what find_layer_stack finds
    first = _signature(layers[1])
    for i in range(2, n):
        if _signature(layers[i]) != first:
            return f"layer {i} differs from layer 1 (class, weights or attributes)", path
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == n and len({repr(v) for v in value}) > 1:
            return f"config.{key} differs between layers", path
    return None, path


def truncated(twin: torch.nn.Module, path: str, keep: int) -> torch.nn.Module:
    """Cut the (meta) twin's layer stack to ``keep`` layers, in place, and its config with it."""
    parent_name, _, attr = path.rpartition(".")
    parent = twin.get_submodule(parent_name) if parent_name else twin
    setattr(parent, attr, torch.nn.ModuleList(list(getattr(parent, attr))[:keep]))
    for sub in twin.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "num_hidden_layers", None) not in (None, keep):
            cfg.num_hidden_layers = keep
            for key, value in list(vars(cfg).items()):
                if isinstance(value, list) and len(value) > keep:
                    setattr(cfg, key, value[:keep])
    return twin


def _layer_of(node: fx.Node, pattern: "re.Pattern[str]") -> Optional[int]:
    if node.op == "get_attr":
        m = pattern.match(str(node.target))
        return int(m.group(1)) if m else None
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _ in stack.values():
        m = pattern.match(str(fqn))
        if m:
            return int(m.group(1))
    return None


def _rename(value: Any, path: str, src: int, dst: int) -> Any:
    return (
        re.sub(rf"(?<![\w.]){re.escape(path)}\.{src}(?=\.|$)", f"{path}.{dst}", value)
        if isinstance(value, str)
        else value
    )


def _renamed_stack(stack: Dict[str, Tuple[str, Any]], path: str, src: int, dst: int) -> Dict[str, Tuple[str, Any]]:
    """Export's module stack of a layer-``src`` node, for layer ``dst``: the paths and the keys built
    from them (``L__self__<path>``)."""
    in_key = re.compile(rf"{re.escape(path)}\.{src}(?=\.|$)")
    return {in_key.sub(f"{path}.{dst}", k): (_rename(fqn, path, src, dst), t) for k, (fqn, t) in stack.items()}


def _leaf_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return a is b or str(a) == str(b)
    return type(a) is type(b) and a == b


def stamp_layers(gm: fx.GraphModule, path: str, layers: torch.nn.ModuleList) -> str:
    """Append layers ``TRACED..len(layers)-1`` to ``gm`` (an export of the model cut to ``TRACED``
    layers at ``path``) as copies of layer ``TRACED-1``, reading the tensors of ``layers`` (the full
    stack of the meta twin). Raises ``ValueError`` naming the first difference when the traced
    layers are not copies of each other (the caller then exports the whole model)."""
    graph, num_layers = gm.graph, len(layers)
    pattern = re.compile(rf"^{re.escape(path)}\.(\d+)(?:\.|$)")
    layer_nodes: List[List[fx.Node]] = [[] for _ in range(TRACED)]
    owner: Dict[fx.Node, int] = {}
    for node in graph.nodes:
        i = _layer_of(node, pattern)
        if i is not None:
            layer_nodes[i].append(node)
            owner[node] = i

    def inputs_from(i: int) -> List[fx.Node]:
        """Nodes of layer i-1 that layer i reads."""
        found = []
        for node in layer_nodes[i]:
            for arg in node.all_input_nodes:
                if owner.get(arg) == i - 1 and arg not in found:
                    found.append(arg)
        return found

    last = TRACED - 1
    # Layer `last` must read one value of its predecessor (the residual stream). Layer `last-1` may
    # read more of layer 0: values export computed once there and shares (the MoE routing's
    # constants); layer `last` reads those from layer 0 directly, and so will its copies.
    ins_prev, ins_last = inputs_from(last - 1), inputs_from(last)
    if len(ins_last) != 1 or not ins_prev:
        raise ValueError(f"layer {last} reads {len(ins_last)} values of its predecessor (need one)")
    residual_prev: List[fx.Node] = []  # what layer `last-1` reads where layer `last` reads ins_last[0]
    a_nodes, b_nodes = layer_nodes[last], layer_nodes[last - 1]
    if len(a_nodes) != len(b_nodes) or not a_nodes:
        raise ValueError(f"layer {last} has {len(a_nodes)} nodes, layer {last - 1} has {len(b_nodes)}")
    readers = [u for u in graph.nodes if owner.get(u) is None and any(owner.get(x) == last for x in u.all_input_nodes)]
    outs = {x for u in readers for x in u.all_input_nodes if owner.get(x) == last}
    if len(outs) != 1:
        raise ValueError(f"the nodes after the layers read {len(outs)} values of the last layer (need one)")
    out_last = outs.pop()
    pos = {n: k for k, n in enumerate(a_nodes)}
    for a, b in zip(a_nodes, b_nodes):  # layer `last` must be layer `last-1` node for node
        ta = _rename(a.target, path, last, last - 1) if a.op == "get_attr" else a.target
        if a.op != b.op or ta != b.target:
            raise ValueError(f"layer {last} node {a.name} ({a.target}) differs from {b.name} ({b.target})")
        la: List[Any] = []
        lb: List[Any] = []
        fx.node.map_aggregate((a.args, a.kwargs), la.append)
        fx.node.map_aggregate((b.args, b.kwargs), lb.append)
        if len(la) != len(lb):
            raise ValueError(f"layer {last} node {a.name} has other arguments than {b.name}")
        for x, y in zip(la, lb):
            if isinstance(x, fx.Node):
                if x in pos:
                    ok = y is b_nodes[pos[x]]
                elif x is ins_last[0]:
                    residual_prev.append(y)
                    ok = y in ins_prev and y is residual_prev[0]
                else:
                    ok = x is y
            else:
                ok = _leaf_equal(x, y)
            if not ok:
                raise ValueError(f"layer {last} node {a.name} reads {x} where layer {last - 1} reads {y}")

    def register(target: str, value: torch.Tensor) -> None:
        *parents, name = target.split(".")
        mod = gm
        for p in parents:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        if isinstance(value, torch.nn.Parameter):
            mod.register_parameter(name, value)
        else:
            mod.register_buffer(name, value)

    prev_out, anchor = out_last, a_nodes[-1]
    for i in range(TRACED, num_layers):
        env: Dict[fx.Node, fx.Node] = {ins_last[0]: prev_out}
        for a in a_nodes:
            with graph.inserting_after(anchor):
                new = graph.node_copy(a, lambda x, env=env: env.get(x, x))
            anchor = env[a] = new
            if "nn_module_stack" in a.meta:
                new.meta["nn_module_stack"] = _renamed_stack(a.meta["nn_module_stack"], path, last, i)
            if a.op == "get_attr":
                new.target = _rename(a.target, path, last, i)
                rest = new.target[len(f"{path}.{i}.") :]
                try:
                    value: torch.Tensor = layers[i].get_parameter(rest)
                except AttributeError:
                    try:
                        value = layers[i].get_buffer(rest)
                    except AttributeError:  # a tensor the layer made in its forward (export lifted it)
                        raise ValueError(f"layer {last} reads {a.target}, which is not a weight of layer {i}") from None
                register(new.target, value)
        prev_out = env[out_last]
    for reader in readers:
        reader.replace_input_with(out_last, prev_out)
    graph.lint()
    return f"traced {TRACED} of {num_layers} layers; layers {TRACED}-{num_layers - 1} stamped from layer {last}"


__all__ = ["TRACED", "find_layer_stack", "why_not_stampable", "truncated", "stamp_layers"]
