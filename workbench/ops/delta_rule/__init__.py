"""Delta-rule ops (DeltaNet, gated delta nets of Qwen3-Next / Qwen3.5 / OLMo-hybrid); see README.md."""

from .torch_delta_rule import DELTA_RULE, GATED_DELTA_RULE  # noqa: F401  (define the (gated) delta-rule ops)
