"""Attention ops; see README.md for the table."""

from .cpu_cached_attention import cpu_cached_attention  # noqa: F401
from .flashinfer_cached_attention import flashinfer_cached_attention  # noqa: F401
from .torch_attention import torch_attention, visible_keys  # noqa: F401
from .torch_attention_repeat_kv import torch_attention_repeat_kv  # noqa: F401
from .torch_attention_sdpa import torch_attention_sdpa  # noqa: F401
from .torch_cached_attention import torch_cached_attention  # noqa: F401
from .triton_cached_attention import triton_cached_attention  # noqa: F401
