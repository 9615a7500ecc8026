"""``apply_sharding_hints`` (stage ``sharding``): shard a graph by the hints its model exported.

The alternative to ``detect_sharding`` + ``sharding_transform_executor`` for sharding-aware custom
models (``models/custom/modeling_*_ir.py``, picked by a registry entry's ``custom_models:
sharding_ir``). Opt-in: ``default.yaml`` lists it disabled, and ``models/configs/enable_sharder_ir.yaml``
disables the detected sharding and enables this one. The rewrite itself is ``hints.py``.

At world size 1 nothing is cut, but the hinted nodes are still lowered to their plain ops (the
hint ops copy their outputs; the aten ops are what later transforms know).
"""

from __future__ import annotations

from typing import List, Literal, Optional, Tuple

import torch
from pydantic import Field

from ...context import PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, nothing_to_do, register, rewrite_info
from .hints import HintTarget, apply_hints, hinted_nodes

HintLayer = Literal["mha", "mla", "mlp", "moe", "ssm", "delta", "lm_head", "unknown"]
#: The reference's all-reduce strategy names. This project's ``torch_dist_all_reduce`` runs on the
#: process group's own backend (gloo on CPU, NCCL on GPU) whatever is asked: the requested strategy
#: and the backend that ran are both recorded in the transform's details.
AllReduceStrategy = Literal[
    "AUTO", "NCCL", "ONESHOT", "TWOSHOT", "MIN_LATENCY", "LOWPRECISION", "UB", "MNNVL", "NCCL_SYMMETRIC"
]


class ApplyShardingHintsConfig(TransformConfig):
    allreduce_strategy: AllReduceStrategy = Field(
        default="AUTO",
        description="All-reduce strategy requested for the hinted all_reduce markers (reference names); the "
        "collective runs on the process group's backend (gloo on CPU, NCCL on GPU), recorded in the details.",
    )
    shard_layers: Optional[List[HintLayer]] = Field(
        default=None,
        description="Only hinted nodes of these layer types are sharded (the rest are lowered replicated); "
        "None: every hinted node.",
    )
    run_shape_prop: bool = Field(
        default=True, description="Re-derive the fake values after the weights shrank (local head counts, widths)."
    )


@register("apply_sharding_hints")
class ApplyShardingHints(Transform[ApplyShardingHintsConfig]):
    """Rewrite each ``torch_hint_*`` node for this rank: cut weights, scale sizes, insert collectives."""

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not hinted_nodes(gm):
            return nothing_to_do(
                gm,
                "no sharding-hint ops in the graph: the model is not sharding-aware (a registry entry picks "
                "one with custom_models: sharding_ir)",
            )
        layers = self.config.shard_layers
        target = HintTarget(
            ctx.dist.world_size, ctx.dist.rank, ctx.dist.group_name, frozenset(layers) if layers is not None else None
        )
        counts = apply_hints(gm, target)
        details = {
            **counts,
            "world_size": ctx.dist.world_size,
            "allreduce_strategy": self.config.allreduce_strategy,
            "allreduce_backend": ctx.dist.backend or "none (world size 1)",
        }
        lowered = sum(v for k, v in counts.items() if k.startswith("hinted_"))
        gm, info = rewrite_info(gm, lowered, details)
        return gm, info.model_copy(update={"has_valid_shapes": False})  # run_shape_prop re-derives them


__all__ = ["ApplyShardingHints", "ApplyShardingHintsConfig"]
