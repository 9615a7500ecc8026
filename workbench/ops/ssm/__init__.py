"""Mamba-2 selective state space ops (the SSD scan and its cached forms); see README.md."""

from .cached_ssm_scan import torch_cached_ssm  # noqa: F401
from .ssm_scan import torch_ssm  # noqa: F401
from .triton_ssm import triton_cached_ssm  # noqa: F401
