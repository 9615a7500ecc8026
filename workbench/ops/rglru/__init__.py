"""RG-LRU ops (RecurrentGemma / Griffin's real-gated linear recurrence); see README.md."""

from .torch_cached_rglru import torch_cached_rglru  # noqa: F401
from .torch_rglru import torch_rglru  # noqa: F401
from .triton_rglru import triton_cached_rglru  # noqa: F401  (triton backend)
