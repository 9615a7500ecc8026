"""``insert_cached_residual_add`` (stage ``cache_init``): store the marked residual-stream hidden
states of every step in per-token cache buffers.

``detect_hidden_states_for_capture`` marks the residual add that ends each chosen decoder layer
(``meta['wb_capture_hidden_state'] = layer``). EAGLE-3 style speculative decoding feeds a draft
model with those hidden states of the tokens the target model just processed, so the cached graph
writes them, each step, into a buffer that outlives the forward::

    h = add(residual, branch)                       [b, s, H]   (the marked node, unchanged)
    hidden_states_cache_<layer>.index_copy_(0, arange(b*s), h.reshape(-1, H))   cache [max_num_tokens, H]

Row t of the buffer is flattened token t of the step (the same order as ``input_ids [1, T]``).
The write is an in-place ``aten.index_copy_`` into a graph input, so dead-code elimination keeps it
although nothing reads its result (a ``copy_`` into ``cache[:b*s]`` would need the fake shapes to
prove ``min(max_num_tokens, b*s) == b*s``, which they cannot). Nothing marked (the default, no speculative decoding)
means nothing to do.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.fx as fx
from pydantic import Field, field_validator

from ....runtime.interface import PER_TOKEN, CacheSpec
from ...context import CACHE_SPECS, PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import annotate_new_nodes
from .inputs import CAPTURE_KEY, cache_input

aten = torch.ops.aten


def hidden_state_cache_name(layer: int) -> str:
    return f"hidden_states_cache_{layer}"


# The write is one ``aten.index_copy_`` that every device runs: there is no kernel to choose.
RESIDUAL_ADD_BACKENDS = ("auto", "torch")


class InsertCachedResidualAddConfig(TransformConfig):
    """The reference shares ``InsertCachedAttentionConfig`` here, hence ``backend``."""

    backend: Optional[str] = Field(
        default=None,
        description="The backend of the hidden-state write: auto | torch (None: auto). The write is one "
        "aten.index_copy_ into the cache buffer on any device, so both mean that.",
    )

    @field_validator("backend")
    @classmethod
    def _known(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v not in RESIDUAL_ADD_BACKENDS:
            raise ValueError(
                f"unknown backend {v!r} for the hidden-state write; choose {' or '.join(RESIDUAL_ADD_BACKENDS)} "
                "(it is one aten.index_copy_ on every device: no other kernel exists)"
            )
        return v


@register("insert_cached_residual_add")
class InsertCachedResidualAdd(Transform[InsertCachedResidualAddConfig]):
    """Write each marked layer output into ``hidden_states_cache_<layer>`` every step."""

    provides = (CACHE_SPECS,)

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            return gm, TransformInfo(num_matches=0, skip_reason="not a graph (transformers mode captures nothing)")
        marked = [n for n in gm.graph.nodes if CAPTURE_KEY in n.meta]
        if not marked:
            return gm, TransformInfo(num_matches=0, skip_reason="no hidden states marked for capture")
        device = ctx.device
        specs: List[CacheSpec] = []
        g = gm.graph
        for node in marked:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or not isinstance(val.shape[-1], int):
                raise ValueError(f"marked hidden state {node.name} has no static hidden size in meta['val']")
            layer, hidden = node.meta[CAPTURE_KEY], val.shape[-1]
            spec = CacheSpec(hidden_state_cache_name(layer), PER_TOKEN, (hidden,), val.dtype, layer)
            cache = cache_input(gm, spec, val.dtype, device)
            before = set(g.nodes)
            with g.inserting_after(node):
                flat = g.call_function(aten.reshape.default, (node, [-1, hidden]))
            with g.inserting_after(flat):
                n_tok = g.call_function(aten.sym_size.int, (flat, 0))
            with g.inserting_after(n_tok):
                rows = g.call_function(aten.arange.default, (n_tok,), {"dtype": torch.int64, "device": device})
            with g.inserting_after(rows):
                g.call_function(aten.index_copy_.default, (cache, 0, rows, flat))
            annotate_new_nodes(gm, [n for n in g.nodes if n not in before], [], anchor=node)
            specs.append(spec)
        g.lint()
        gm.recompile()
        ctx.cache.declare(specs, ctx.dtype, ctx.limits.page_size)
        return gm, TransformInfo(
            num_matches=len(specs),
            is_clean=True,
            has_valid_shapes=True,
            details={
                "captured_layers": sorted(s.layer for s in specs),
                "new_inputs": [s.name for s in specs],
                "backend": "torch (aten.index_copy_)",
            },
        )


__all__ = ["InsertCachedResidualAdd", "hidden_state_cache_name"]
