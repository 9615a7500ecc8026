"""Normalization ops; see README.md for the table."""

from .torch_norms import torch_l2norm, torch_rmsnorm  # noqa: F401
