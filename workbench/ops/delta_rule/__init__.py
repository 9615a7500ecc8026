"""Delta-rule ops (DeltaNet, gated delta nets of Qwen3-Next / Qwen3.5 / OLMo-hybrid); see README.md."""

from .torch_delta_rule import (  # noqa: F401
    torch_cached_delta_rule,
    torch_cached_gated_delta_rule,
    torch_delta_rule,
    torch_gated_delta_rule,
    triton_cached_delta_rule,
    triton_cached_gated_delta_rule,
)
