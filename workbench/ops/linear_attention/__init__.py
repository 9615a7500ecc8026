"""Linear attention with a per-token, per-head log decay (MiniMax lightning attention); see README.md."""

from .linear_attention import LINEAR_ATTENTION  # noqa: F401  (defines torch_linear_attention and its cached forms)
