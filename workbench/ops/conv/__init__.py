"""Causal conv ops (short depthwise convs of SSM / delta-rule / LFM2 mixers); see README.md."""

from .causal_conv import torch_cached_causal_conv1d, torch_causal_conv1d  # noqa: F401
from .triton_causal_conv import triton_cached_causal_conv1d_op  # noqa: F401  (the "triton" cached backend)
