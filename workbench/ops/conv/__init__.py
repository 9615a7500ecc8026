"""Causal conv ops (short depthwise convs of SSM / delta-rule / LFM2 mixers); see README.md."""

from .causal_conv import torch_cached_causal_conv1d, torch_causal_conv1d, triton_cached_causal_conv1d  # noqa: F401
