"""RG-LRU ops (RecurrentGemma / Griffin's real-gated linear recurrence); see README.md."""

from .torch_rglru import RGLRU  # noqa: F401  (defines torch_rglru and its cached forms)
