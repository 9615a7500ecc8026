"""Normalization ops; see README.md for the table."""

from .flashinfer_rmsnorm import flashinfer_rmsnorm  # noqa: F401
from .torch_norms import torch_l2norm, torch_rmsnorm  # noqa: F401
from .triton_rmsnorm import triton_rmsnorm  # noqa: F401
