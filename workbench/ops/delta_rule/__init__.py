"""Delta-rule ops (DeltaNet, gated delta nets of Qwen3-Next / Qwen3.5 / OLMo-hybrid); see README.md."""

from .torch_cached_delta_rule import torch_cached_delta_rule, torch_cached_gated_delta_rule  # noqa: F401
from .torch_delta_rule import torch_delta_rule, torch_gated_delta_rule  # noqa: F401
from .triton_delta_rule import triton_cached_delta_rule, triton_cached_gated_delta_rule  # noqa: F401  (triton backends)
