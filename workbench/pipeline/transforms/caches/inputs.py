"""Graph inputs of a cached graph: adding them, describing them, and feeding them.

The cache stage turns ``(input_ids, position_ids) -> logits`` into
``(input_ids, position_ids, seq_lens, input_pos, page_table, num_prefill, <caches...>) -> logits``.
New inputs are placeholders with a fake value in ``meta['val']`` (symbolic sizes from the graph's
own shape environment), so the graph stays printable, renderable and shape-propagatable, and
with ``meta['wb_cache_input']`` naming what the runtime feeds them (metadata name or cache
resource key). Export's pytree calling convention is rebuilt to take the extra positional inputs.

Not a transform itself: helpers for ``insert_cached_attention``, ``insert_cached_residual_add`` and
``gather_logits_before_lm_head`` (the probe of a cached graph is the runtime's ``CachedProbe``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import DimDynamic
from torch.utils import _pytree as pytree

from ....runtime.interface import INPUT_KEY, METADATA_INPUTS, PAGED, SLOT, SLOT_INPUT, CacheSpec

# node.meta key: detect_hidden_states_for_capture marks a layer's output hidden state with its layer
# index; insert_cached_residual_add writes every marked one into a per-token cache.
CAPTURE_KEY = "wb_capture_hidden_state"
_SYMBOLS_KEY = "wb_cache_symbols"  # gm.meta: symbolic sizes shared by all cache inputs


def graph_fake_mode(gm: fx.GraphModule):
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if v is not None])
    if mode is None or mode.shape_env is None:
        raise RuntimeError(
            "the graph's inputs carry no fake values with a shape environment (was it exported with "
            "torch.export?); the cache stage needs them to describe its new inputs"
        )
    return mode


def _symbol(gm: fx.GraphModule, name: str, hint: int):
    """A named symbolic size (one per name and graph), e.g. ``num_pages``."""
    table = dict(gm.meta.get(_SYMBOLS_KEY, {}))
    if name not in table:
        # imported here: torch._dynamo (with Inductor and Triton) is not needed to import the transforms
        from torch._dynamo.source import ConstantSource

        env = graph_fake_mode(gm).shape_env
        sym = env.create_symbol(hint, source=ConstantSource(f"wb_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
        table[name] = env.create_symintnode(sym, hint=hint)
        gm.meta[_SYMBOLS_KEY] = table  # a new dict: snapshots share the old one
    return table[name]


def _fake(gm: fx.GraphModule, shape: Sequence[Any], dtype: torch.dtype, device: torch.device):
    with graph_fake_mode(gm):
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def find_input(gm: fx.GraphModule, key: str) -> Optional[fx.Node]:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get(INPUT_KEY, n.name) == key:
            return n
    return None


def add_graph_input(gm: fx.GraphModule, key: str, val: Any) -> fx.Node:
    """Append a placeholder fed by ``key``, with fake value ``val``; fix export's input spec."""
    if find_input(gm, key) is not None:
        raise ValueError(f"the graph already has an input {key!r}")
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(key)
    node.meta["val"] = val
    node.meta[INPUT_KEY] = key
    _rebuild_input_spec(gm)
    return node


def _rebuild_input_spec(gm: fx.GraphModule) -> None:
    """Export's codegen flattens ``(args, kwargs)`` with a fixed spec: extend it to every placeholder.

    A new codegen object, never an in-place edit: snapshot graph copies share the old one.
    """
    codegen = gm.graph._codegen
    if not isinstance(codegen, fx.graph._PyTreeCodeGen):
        return  # plain positional codegen: the new placeholder is simply a new argument
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = pytree.tree_structure((tuple(range(len(names))), {}))
    info = fx.graph._PyTreeInfo(names, in_spec, codegen.pytree_info.out_spec)
    gm.graph._codegen = fx.graph._PyTreeCodeGen(info)
    gm._in_spec = in_spec


def metadata_inputs(gm: fx.GraphModule, device: torch.device) -> Dict[str, fx.Node]:
    """The four metadata inputs (created once per graph): seq_lens/input_pos [B] int32,
    page_table [B, max_pages_per_seq] int32, num_prefill (a symbolic int)."""
    out = {k: find_input(gm, k) for k in METADATA_INPUTS}
    if all(v is not None for v in out.values()):
        return out
    b, pages = _symbol(gm, "num_seqs", 3), _symbol(gm, "max_pages_per_seq", 5)
    vals = {
        "seq_lens": _fake(gm, (b,), torch.int32, device),
        "input_pos": _fake(gm, (b,), torch.int32, device),
        "page_table": _fake(gm, (b, pages), torch.int32, device),
        "num_prefill": _symbol(gm, "num_prefill", 1),
    }
    for key in METADATA_INPUTS:
        if out[key] is None:
            out[key] = add_graph_input(gm, key, vals[key])
    return out


def per_sequence_input(gm: fx.GraphModule, key: str, dtype: torch.dtype, device: torch.device) -> fx.Node:
    """A new [num_seqs] input (one value per sequence of the step), e.g. ``last_token_index``."""
    return add_graph_input(gm, key, _fake(gm, (_symbol(gm, "num_seqs", 3),), dtype, device))


def slot_input(gm: fx.GraphModule, device: torch.device) -> fx.Node:
    """``slot_idx [num_seqs] int32`` (created once per graph): each sequence's row of the SLOT states."""
    return find_input(gm, SLOT_INPUT) or per_sequence_input(gm, SLOT_INPUT, torch.int32, device)


def cache_input(gm: fx.GraphModule, spec: CacheSpec, dtype: torch.dtype, device: torch.device) -> fx.Node:
    """A cache placeholder: [num_pages, page_size, *shape] (paged), [num_slots, *shape] (per-sequence
    state) or [max_num_tokens, *shape] (per-step buffer)."""
    if spec.kind == PAGED:
        lead: Tuple[Any, ...] = (_symbol(gm, "num_pages", 7), _symbol(gm, "page_size", 11))
    elif spec.kind == SLOT:
        lead = (_symbol(gm, "num_slots", 5),)
    else:
        lead = (_symbol(gm, "max_num_tokens", 13),)
    return add_graph_input(gm, spec.name, _fake(gm, (*lead, *spec.shape), spec.dtype or dtype, device))


__all__ = [
    "CAPTURE_KEY",
    "graph_fake_mode",
    "find_input",
    "add_graph_input",
    "metadata_inputs",
    "per_sequence_input",
    "cache_input",
    "slot_input",
]
