"""Linear attention with a per-token, per-head log decay (MiniMax lightning attention); see README.md."""

from .cached_linear_attention import torch_cached_linear_attention  # noqa: F401
from .linear_attention import torch_linear_attention  # noqa: F401
from .triton_linear_attention import triton_cached_linear_attention  # noqa: F401  (triton backend)
