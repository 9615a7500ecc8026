"""Causal conv ops (short depthwise convs of SSM / delta-rule / LFM2 mixers); see README.md."""

from .causal_conv import CAUSAL_CONV  # noqa: F401  (defines torch_causal_conv1d and its cached forms)
