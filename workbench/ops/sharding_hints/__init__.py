"""Sharding-hint ops (``torch.ops.workbench.torch_hint_*``): plain ops that say how they shard; see README.md."""

from .hint_ops import (  # noqa: F401
    LAYER_TYPES,
    TP_MODES,
    torch_hint_all_gather,
    torch_hint_all_reduce,
    torch_hint_linear,
    torch_hint_moe,
    torch_hint_split_with_sizes,
    torch_hint_view,
)
