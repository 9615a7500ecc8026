"""Tensor and expert parallelism on the canonical graph: plan (``detect``), rewrite (``apply``),
the per-op rules for linears (``linear_ops``). The transforms are in ``transforms/sharding/transforms.py``."""

from .apply import SHARDING_META, apply_plan, take_shard
from .detect import detect_plan
from .plan import NodeCut, Region, ShardingPlan, TensorCut, split_evenly

__all__ = [
    "ShardingPlan",
    "Region",
    "NodeCut",
    "TensorCut",
    "split_evenly",
    "detect_plan",
    "apply_plan",
    "take_shard",
    "SHARDING_META",
]
