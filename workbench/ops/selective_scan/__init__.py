"""Mamba-1 selective scan ops (the per-channel-decay scan and its cached forms); see README.md."""

from .cached_selective_scan import torch_cached_selective_scan_op  # noqa: F401
from .selective_scan import torch_selective_scan_op  # noqa: F401
from .triton_selective_scan import triton_cached_selective_scan_op  # noqa: F401  (the "triton" cached backend)
