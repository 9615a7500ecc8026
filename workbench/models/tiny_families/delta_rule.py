"""Tiny random configs of the delta_rule families (merged into ``workbench.models.tiny.TINY_ARCHS``).

* ``qwen3_next``: 4 layers -- gated delta net, full attention, gated delta net, full attention
  (heterogeneous: ``export_to_gm`` exports it whole, no stamping). Gated delta nets with 2 key heads
  and 4 value heads of 16 (grouped value heads: each key head serves two value heads), conv kernel
  4; full attention with Qwen3-Next's output gate, q/k norms and partial rotary (a quarter of head
  dim 16), 4 query / 2 KV heads; every layer's MLP is the MoE: 4 experts, top-2, expert width 64,
  plus a gated shared expert of 64. Vocab 512, hidden 64.
* ``qwen3_5`` / ``qwen3_5_moe``: Qwen3.5's text stack, 2 layers -- a gated delta net spelled with
  separate projections (one q|k|v projection, z, b, a: ``canonical_split_gated_delta_net``), then
  full attention (output gate, q/k norms, partial rotary); the MoE variant with Qwen3-Next's MoE.
  The delta net's heads as Qwen3-Next's (2 key heads serving 4 value heads).
* ``olmo_hybrid``: OLMo-Hybrid, 2 layers -- a gated delta net with separate q, k, v projections and
  beta doubled (``linear_allow_neg_eigval``), then full attention.
* ``deltanet``: the ungated delta rule, which no transformers family uses: the small HF-form model
  of ``deltanet_model.py`` (4 identical layers, so ``export_to_gm`` stamps layers 3.. from layer 2),
  4 heads of 16, conv kernel 4, SwiGLU MLP 128. Building it registers the model with transformers'
  Auto classes (see ``deltanet_model.register_deltanet``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sizes import LINEAR_THEN_FULL_TWICE, QWEN_MOE, SMALL_TOKEN_IDS, TRANSFORMER
from .spec import TinyConfig, tiny_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: Qwen3-Next's gated delta nets: 2 key heads and 4 value heads of 16 (each key head serves two).
GATED_DELTA_NET_HEADS: dict = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
)
#: Qwen3-Next's MoE on every layer: 4 experts of width 64, top-2, plus a gated shared expert of 64.
QWEN3_NEXT_MOE: dict = dict(QWEN_MOE, shared_expert_intermediate_size=64)


def _linear_then_full(model_type: str, **fields: Any) -> TinyConfig:
    """A gated delta net (Qwen3-Next's head sizes, conv kernel 4) then full attention: the hybrids'
    pattern at its smallest, for the families configured by model type."""
    return tiny_config(
        model_type,
        TRANSFORMER,
        GATED_DELTA_NET_HEADS,
        SMALL_TOKEN_IDS,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        **fields,
    )


def _deltanet() -> PretrainedConfig:
    """The tiny DeltaNet: registers its model with transformers' Auto classes first (no config class
    of transformers' own to name)."""
    from .deltanet_model import DeltaNetConfig, register_deltanet

    register_deltanet()
    config = DeltaNetConfig(num_hidden_layers=4)
    config._attn_implementation = "eager"  # no attention at all; sdpa is refused by models without it
    return config


ARCHS: dict = {
    "qwen3_next": tiny_config(
        "Qwen3NextConfig",
        TRANSFORMER,
        GATED_DELTA_NET_HEADS,
        QWEN3_NEXT_MOE,
        LINEAR_THEN_FULL_TWICE,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen3_5": _linear_then_full("qwen3_5_text"),
    "qwen3_5_moe": _linear_then_full("qwen3_5_moe_text", **QWEN3_NEXT_MOE),
    "olmo_hybrid": _linear_then_full("olmo_hybrid", linear_allow_neg_eigval=True),
    "deltanet": _deltanet,
}
