"""The graph rewrite behind every per-sequence-state cache (conv, SSM, delta rule, gated delta rule).

For a node of a stateful canonical op (``workbench.ops.state``: ``torch_causal_conv1d``,
``torch_ssm``, ``torch_gated_delta_rule``, ...)::

    y [b, s, ...] = torch_X(x [b, s, ...], w, ..., *, opts)
->  xf = reshape(x, [1, -1, ...])                                     per-token args only
    yf = torch_cached_X(xf, w, ..., seq_lens, input_pos, slot_idx, num_prefill, state_0, ..., *, opts)
    y  = reshape(yf, [b, s, ...])                                      b, s read from x itself

and the graph gains ``slot_idx`` (once) and one ``[num_slots, *state_shape]`` input per state tensor
of the node (``CacheSpec`` kind ``SLOT``, named ``<state>_<layer>``). The runtime feeds
``input_ids [1, T]`` (the whole step flattened), so the reshapes are views; the numerics probe's
``[b, s]`` batch of b fresh prefill sequences works unchanged, as for cached attention.

Not a transform itself: ``transforms/caches/state.py`` holds the four ``insert_cached_*`` keys.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ....ops.state import StatefulOp, stateful_op_for
from ....runtime.interface import SLOT, CacheSpec
from ...graph.utils import require_tensor_meta
from ...matcher import annotate_new_nodes, named_args
from .inputs import cache_input, metadata_inputs, slot_input

aten = torch.ops.aten
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|decoder\.layers)\.(\d+)(?:\.|$)")


def stateful_nodes(gm: fx.GraphModule, insert_key: Optional[str] = None) -> List[Tuple[fx.Node, StatefulOp]]:
    """Nodes of uncached stateful ops (those owned by ``insert_key`` only, when given), in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = stateful_op_for(node.target)
        if op is not None and (insert_key is None or op.insert_key == insert_key):
            out.append((node, op))
    return out


def decoder_layer(node: fx.Node) -> Optional[int]:
    """The decoder layer index a node was traced in (from its module stack: ``model.layers.3.mixer``)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        m = _LAYER.search(str(path))
        if m:
            return int(m.group(1))
    return None


def _static_rest(node: fx.Node, what: str) -> List[int]:
    shape = require_tensor_meta(node).shape
    rest = list(shape[2:])
    if not all(isinstance(d, int) for d in rest):
        raise ValueError(f"{what} {node.name}: the dims after [batch, seq] must be static, got {tuple(shape)}")
    return rest


def rewrite_stateful_node(
    gm: fx.GraphModule,
    node: fx.Node,
    op: StatefulOp,
    backend: str,
    index: int,
    dtype: torch.dtype,
    device: torch.device,
) -> List[CacheSpec]:
    """Replace one uncached stateful node by its cached op; returns the state specs it reads."""
    schema = node.target._schema
    args = dict(named_args(node))
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    kwonly = [a.name for a in schema.arguments if a.kwarg_only]
    missing = [a for a in op.token_args if a not in positional]
    if missing:
        raise ValueError(f"stateful op {op.source}: token args {missing} are not positional args of its schema")
    fakes = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in args.items()}
    layer = decoder_layer(node)
    layer = index if layer is None else layer
    specs = []
    for st in op.states:
        shape = tuple(int(d) for d in st.shape(fakes))
        specs.append(CacheSpec(f"{st.name}_{layer}", SLOT, shape, st.dtype, layer))
    taken = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    if any(s.name in taken for s in specs):  # two nodes of one op in a layer: number them instead
        specs = [CacheSpec(f"{s.name}_{layer}_{index}", SLOT, s.shape, s.dtype, layer) for s in specs]
    meta = metadata_inputs(gm, device)
    slot = slot_input(gm, device)
    states = [cache_input(gm, s, dtype, device) for s in specs]
    first = args[op.token_args[0]]
    out_rest = _static_rest(node, f"{op.source} output")

    g = gm.graph
    before = set(g.nodes)
    with g.inserting_before(node):
        values: List[Any] = []
        for name in positional:
            v = args[name]
            if name in op.token_args:
                v = g.call_function(aten.reshape.default, (v, [1, -1, *_static_rest(v, f"{op.source} arg {name}")]))
            values.append(v)
        out = g.call_function(
            op.cached_op(backend),
            (*values, meta["seq_lens"], meta["input_pos"], slot, meta["num_prefill"], *states),
            {k: args[k] for k in kwonly},
        )
        b = g.call_function(aten.sym_size.int, (first, 0))
        s = g.call_function(aten.sym_size.int, (first, 1))
        res = g.call_function(aten.reshape.default, (out, [b, s, *out_rest]))
    node.replace_all_uses_with(res)
    annotate_new_nodes(gm, [n for n in g.nodes if n not in before], [node.name], anchor=node)
    g.erase_node(node)
    return specs


def uncached_state_ops(gm: fx.GraphModule) -> Dict[str, str]:
    """Stateful nodes still uncached: node name -> the insert transform that would cache them."""
    return {n.name: op.insert_key for n, op in stateful_nodes(gm)}


__all__ = ["stateful_nodes", "decoder_layer", "rewrite_stateful_node", "uncached_state_ops"]
