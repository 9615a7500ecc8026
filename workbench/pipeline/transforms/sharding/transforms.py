"""Stage ``sharding``: ``detect_sharding`` plans how each layer splits over the ranks,
``sharding_transform_executor`` rewrites the graph by the plan (``pipeline/transforms/sharding/``).

Both run in every rank of a sharded run (``Workbench(world_size=N)``, ``workbench run
--world-size N``, torchrun), on the graph traced on meta, before ``load_weights``: the executor
turns each cut weight into a meta tensor of the local shape plus a binding that ``load_weights``
follows, so a rank never holds more than its slice in the graph. At world size 1 both report 0
matches with the reason and leave the graph alone.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Tuple, TypeVar

import torch
from pydantic import Field

from ...context import SHARDING_PLAN, PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, nothing_to_do, register, rewrite_info
from .plans import apply_plan, detect_plan

ShardLayer = Literal["mha", "mlp", "moe", "lm_head"]
ShardDim = Literal["tp", "ep"]


def _all_dims() -> List[ShardDim]:
    return ["tp", "ep"]


class DetectShardingConfig(TransformConfig):
    sharding_dims: List[ShardDim] = Field(
        default_factory=_all_dims,
        description="Kinds of parallelism to plan: tp (attention heads, MLP features, LM-head vocab) and "
        "ep (MoE experts over ranks).",
    )
    shard_layers: Optional[List[ShardLayer]] = Field(
        default=None,
        description="Only these region kinds are split (mha, mlp, moe, lm_head); None: every shardable one.",
    )


_ConfigT = TypeVar("_ConfigT", bound=TransformConfig)


class _ShardingTransform(Transform[_ConfigT]):
    """A sharding transform: nothing to do with one rank, else ``_shard``."""

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not ctx.dist.sharded:
            return nothing_to_do(
                gm,
                "world size 1: nothing to shard (Workbench(..., world_size=N), "
                "`workbench run --world-size N` or torchrun start N ranks)",
            )
        return self._shard(gm, ctx)

    def _shard(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        raise NotImplementedError


@register("detect_sharding")
class DetectSharding(_ShardingTransform[DetectShardingConfig]):
    """Plan tensor / expert parallelism for ``ctx.dist.world_size`` ranks (``ctx.sharding``)."""

    provides = (SHARDING_PLAN,)

    def _shard(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        plan = detect_plan(
            gm,
            world_size=ctx.dist.world_size,
            rank=ctx.dist.rank,
            group_name=ctx.dist.group_name,
            vocab_size=ctx.vocab_size,
            dims=self.config.sharding_dims,
            layers=self.config.shard_layers,
        )
        ctx.sharding = plan
        # The graph is unchanged: its state (clean, shapes) stands.
        return gm, TransformInfo(
            num_matches=len(plan.sharded), is_clean=True, has_valid_shapes=True, details=plan.summary()
        )


class ShardingExecutorConfig(TransformConfig):
    run_shape_prop: bool = Field(
        default=True, description="Re-derive the fake values after the weights shrank (local head counts, widths)."
    )


@register("sharding_transform_executor")
class ShardingTransformExecutor(_ShardingTransform[ShardingExecutorConfig]):
    """Apply ``ctx.sharding``: cut weights (bound at load), fix head counts, insert the collectives."""

    needs = (SHARDING_PLAN,)

    def _shard(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        plan = ctx.sharding
        if plan is None:
            return nothing_to_do(gm, "no sharding plan: enable detect_sharding before this transform")
        if plan.applied:
            return nothing_to_do(gm, "the plan was already applied to this graph")
        counts = apply_plan(gm, plan)
        ctx.sharding = plan.with_applied()
        whole, local = plan.bytes()
        details = {
            **counts,
            "sharded_regions": plan.counts(),
            "sharded_weight_bytes": whole,
            "sharded_weight_bytes_this_rank": local,
        }
        gm, info = rewrite_info(gm, len(plan.sharded), details)
        return gm, info.model_copy(update={"has_valid_shapes": False})  # run_shape_prop re-derives them


__all__ = ["DetectSharding", "ShardingTransformExecutor", "DetectShardingConfig", "ShardingExecutorConfig"]
