"""Mamba-1 selective scan ops (the per-channel-decay scan and its cached forms); see README.md."""

from .selective_scan import (  # noqa: F401
    torch_cached_selective_scan,
    torch_selective_scan,
    triton_cached_selective_scan,
)
