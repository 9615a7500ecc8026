"""Mamba-2 selective state space ops (the SSD scan and its cached forms); see README.md."""

from .ssm_scan import torch_cached_ssm, torch_ssm, triton_cached_ssm  # noqa: F401
