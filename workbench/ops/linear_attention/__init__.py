"""Linear attention with a per-token, per-head log decay (MiniMax lightning attention); see README.md."""

from .linear_attention import (  # noqa: F401
    torch_cached_linear_attention,
    torch_linear_attention,
    triton_cached_linear_attention,
)
