"""Collective ops for sharded graphs (``torch.ops.workbench.torch_dist_*``): see README.md."""

from .collectives import torch_dist_all_gather, torch_dist_all_reduce  # noqa: F401
