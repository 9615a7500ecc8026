"""``initialize_mrope_delta_cache`` (stage ``cache_init``): a per-sequence mRoPE position offset.

Qwen2-VL / Qwen2.5-VL give the tokens of an image three positions (temporal, height, width) that
advance more slowly than the token count; the text after it continues from the image's largest
position, not from its token index. HF keeps that shift per sequence (``rope_deltas``: largest
mRoPE position + 1 - number of tokens) and adds it to every later position. A cached graph is fed
plain token positions (``input_pos`` + offset), so the shift has to come from a cache: this
transform declares ``mrope_delta_cache [num_slots, 1] int64`` (a ``SLOT`` cache: one row per
sequence, ``num_slots = max_batch_size + 1``) and rewrites the positions that feed every mRoPE
table (``torch_mrope_cos_sin``, produced at export by ``models/canonical/mrope.py``)::

    cos, sin = torch_mrope_cos_sin(pos [3, b, s], inv_freq, mrope_section, scaling)
->  pos2 = torch_mrope_delta_positions(pos, mrope_delta_cache, seq_lens, slot_idx)   # + delta of the
    cos, sin = torch_mrope_cos_sin(pos2, inv_freq, mrope_section, scaling)           #   token's sequence

Only the rotary positions move: the KV cache, causal masking and ``input_pos`` keep counting tokens.
With zero deltas (what ``initialize_cache`` allocates) the graph computes exactly what it did
before; a text-only model never needs another value. Whoever runs a vision prompt writes its delta
into the row of the sequence's slot before its prefill (the workbench exports the text stack only,
so nothing in it computes deltas) -- and, since slots are reused, a text sequence that follows it
in the same slot needs its row set back to 0.

Enabled per model, never detected (the seed's choice): ``default.yaml`` lists it disabled, and
``workbench/models/configs/qwen2_5_vl.yaml`` switches it on (``Workbench(yaml_extra=[...])``). Enabled
on a graph without an mRoPE table it refuses, naming the export patch that produces one.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.fx as fx

from ....ops.rope import torch_mrope  # noqa: F401  (registers the mRoPE ops)
from ....runtime.interface import SLOT, CacheSpec
from ...context import CACHE_SPECS, PipelineContext
from ...graph.utils import call_nodes
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes
from .inputs import cache_input, find_input, metadata_inputs, slot_input

MROPE_DELTA_CACHE = "mrope_delta_cache"
DELTA_SPEC = CacheSpec(MROPE_DELTA_CACHE, SLOT, (1,), torch.int64)


def mrope_table_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return call_nodes(gm, torch.ops.workbench.torch_mrope_cos_sin.default)


def _offset(node: fx.Node) -> bool:
    """Whether the table's positions already pass through the delta op (the transform ran before)."""
    pos = node.args[0]
    return isinstance(pos, fx.Node) and pos.target is torch.ops.workbench.torch_mrope_delta_positions.default


def add_position_deltas(gm: fx.GraphModule, device: torch.device) -> int:
    """Offset the positions of every mRoPE table node by its sequence's delta; returns how many.
    Adds the ``mrope_delta_cache`` input (and ``seq_lens`` / ``slot_idx`` when missing)."""
    nodes = [n for n in mrope_table_nodes(gm) if not _offset(n)]
    if not nodes:
        return 0
    meta = metadata_inputs(gm, device)
    slot = slot_input(gm, device)
    cache = find_input(gm, MROPE_DELTA_CACHE) or cache_input(gm, DELTA_SPEC, torch.int64, device)
    g = gm.graph
    for node in nodes:
        before = set(g.nodes)
        with g.inserting_before(node):
            shifted = g.call_function(
                torch.ops.workbench.torch_mrope_delta_positions.default, (node.args[0], cache, meta["seq_lens"], slot)
            )
        node.args = (shifted, *node.args[1:])
        annotate_new_nodes(gm, [n for n in g.nodes if n not in before], [node.name], anchor=node)
    return len(nodes)


@register("initialize_mrope_delta_cache")
class InitializeMropeDeltaCache(Transform):
    """Allocate a per-slot mrope_delta_cache and add each sequence's delta to its mRoPE positions."""

    provides = (CACHE_SPECS,)

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            raise TypeError("initialize_mrope_delta_cache rewrites exported graphs, and this model is not exported")
        if not mrope_table_nodes(gm):
            raise ValueError(
                "initialize_mrope_delta_cache is enabled but the graph has no mRoPE table "
                "(torch_mrope_cos_sin): the model is not an mRoPE model (Qwen2-VL / Qwen2.5-VL), or export ran "
                "without the 'canonical_mrope_rotary' patch, or that patch left HF's own forward in place (a "
                "runtime-recomputed rope_type, or a transformers that selects the sections in the attention). "
                "Disable initialize_mrope_delta_cache for this model."
            )
        n = add_position_deltas(gm, ctx.device)
        gm.graph.lint()
        gm.recompile()
        ctx.cache.declare([DELTA_SPEC], ctx.dtype, ctx.limits.page_size)
        details = {
            "tables": len(mrope_table_nodes(gm)),
            "rewritten": n,
            "cache": MROPE_DELTA_CACHE,
            "shape": ["num_slots", 1],
            "dtype": "int64",
            "new_inputs": ["seq_lens", "slot_idx", MROPE_DELTA_CACHE],
        }
        return gm, TransformInfo(num_matches=n, is_clean=True, has_valid_shapes=True, details=details)


__all__ = ["InitializeMropeDeltaCache", "add_position_deltas", "mrope_table_nodes", "MROPE_DELTA_CACHE", "DELTA_SPEC"]
