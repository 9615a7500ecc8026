"""RG-LRU ops (RecurrentGemma / Griffin's real-gated linear recurrence); see README.md."""

from .torch_rglru import torch_cached_rglru, torch_rglru, triton_cached_rglru  # noqa: F401
