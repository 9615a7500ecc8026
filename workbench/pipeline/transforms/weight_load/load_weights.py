"""Stage ``weight_load``: ``load_weights`` binds the graph to real tensors on the pipeline device.

The graph was traced on ``meta`` (``export_to_gm``), so until here it holds no weights. This is the
one place where the device enters the graph: every meta parameter and buffer is replaced by the
eager model's tensor of the same name (``ctx.weights``), copied to the pipeline device only when it
lives elsewhere; ``device=meta`` arguments in the graph are retargeted; all fake values move to
(sizes and strides kept), so the post-load transforms see the
device they run on without a full shape propagation.

Quantized checkpoints: graph tensors a quantize transform declared with ``record_tensor_binding``
(fp8 weights, scales, experts stacked, AWQ repacked) are made here from the checkpoint's raw tensors
(``ctx.weights.checkpoint``) by the declared conversion; ``details`` count them (``bound_by_binding``).

Bytes: the snapshot's memory delta is what the graph now holds (0 before, the model's tensors
after); ``details`` split it into ``bytes_copied`` (moved across devices: a real allocation) and
``bytes_shared`` (already on the device: bound to the eager model's storage, nothing allocated).
On a GPU the snapshot also carries the CUDA allocator's delta, which is the copied part.
"""

from __future__ import annotations

from typing import Tuple

import torch
from pydantic import Field

from ...context import PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...weight_placement import place_weights


class LoadWeightsConfig(TransformConfig):
    expect_mem_change: bool = Field(
        default=True, description="The graph goes from holding no weights (meta) to holding them."
    )


@register("load_weights")
class LoadWeights(Transform[LoadWeightsConfig]):
    """Bind the graph's meta tensors to the model's weights and place everything on the device."""

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        placement = place_weights(gm, ctx.weights, torch.device(ctx.device))
        changed = placement.bound_from_source + len(placement.moved) + placement.device_args_retargeted
        return gm, TransformInfo(
            # fake values were moved to the device one by one (weight_placement.retarget_values): still valid
            num_matches=changed,
            is_clean=True,
            has_valid_shapes=True,
            details=placement.details(),
        )


__all__ = ["LoadWeights", "LoadWeightsConfig"]
