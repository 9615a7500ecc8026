"""RoPE ops; see README.md for the table."""

from .torch_mrope import torch_mrope_cos_sin, torch_mrope_delta_positions  # noqa: F401
from .torch_rope import (  # noqa: F401
    rotate_half,
    torch_rope_with_complex_freqs,
    torch_rope_with_explicit_cos_sin,
    torch_rope_with_qk_interleaving,
)
from .triton_rope import triton_rope_with_explicit_cos_sin  # noqa: F401
