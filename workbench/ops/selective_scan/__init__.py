"""Mamba-1 selective scan ops (the per-channel-decay scan and its cached forms); see README.md."""

from .selective_scan import SELECTIVE_SCAN  # noqa: F401  (defines torch_selective_scan and its cached forms)
