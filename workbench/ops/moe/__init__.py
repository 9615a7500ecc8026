"""Mixture-of-experts ops; see README.md for the table."""

from . import triton_moe_routing  # noqa: F401
from .torch_moe import torch_moe, torch_moe_dense_mlp, torch_moe_fused, torch_moe_local_experts  # noqa: F401
from .torch_moe_routing import torch_moe_topk_softmax  # noqa: F401
from .triton_moe_routing import triton_moe_topk_softmax  # noqa: F401
