"""Tiny random configs of the MLA (multi-head latent attention) families (merged into
``workbench.models.tiny.TINY_ARCHS``).

DeepSeek-V2 attention caches one compressed latent per token (``kv_lora_rank`` values after
``kv_a_layernorm``) plus one rotated RoPE key shared by all heads (``qk_rope_head_dim``), instead
of per-head K and V. The sizes keep every MLA dim distinct so a transposed or mis-split weight
cannot go unnoticed: 4 heads, latent rank 32, rope 8, nope 16, value 16 (so a per-head K is 24
wide and V 16: a per-head K/V cache would hold 4 * (24 + 16) = 160 values per token and layer,
the latent cache 32 + 8 = 40).

MoE as in DeepSeek-V2: the first layer dense (``first_k_dense_replace=1``), the second with 4
routed experts (top-2, greedy) and 1 shared expert.

The families that copy DeepSeek-V3's MLA with cos/sin RoPE each take another point of MLA's shape
space, so the canonical forward and the latent cache are tested over it (their rotary embedding is
``head_dim`` wide: ``head_dim = qk_rope_head_dim`` in each): GLM-4-MoE-Lite without q-LoRA, rope
wider than nope (16 | 8), value heads 24 wide, interleaved RoPE, MoE after a dense layer; MiniCPM3
with q-LoRA and muP-style scales (dense MLP); Youtu with q-LoRA, value heads narrower than nope (12
against 16), plain rotate-half RoPE.
"""

from __future__ import annotations

from .sizes import MLA_DIMS, MLA_HEADS, MLP_WIDTH, SMALL_TOKEN_IDS, WIDTH

#: DeepSeek-V2's MoE at toy size: 4 routed experts (top-2, greedy) of width 64 and 1 shared expert.
DEEPSEEK_V2_MOE: dict = dict(moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
#: The MLA sizes shared by both variants (see the module docstring).
MLA_SIZES: dict = dict(
    **WIDTH,
    **MLP_WIDTH,
    **MLA_HEADS,
    **MLA_DIMS,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    **DEEPSEEK_V2_MOE,
    topk_method="greedy",
)


def _deepseek_v2():
    """DeepSeek-V2(-Lite) shape: queries through one full projection (``q_lora_rank=None``)."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**MLA_SIZES, q_lora_rank=None)


def _deepseek_v2_q_lora():
    """DeepSeek-V2 (full) shape: queries through a low-rank ``q_a_proj -> RMSNorm -> q_b_proj`` too."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**MLA_SIZES, q_lora_rank=24)


def _glm4_moe_lite():
    """GLM-4.7-Flash shape: no q-LoRA, rope 16 | nope 8 | value 24, latent rank 24, interleaved RoPE."""
    from transformers import Glm4MoeLiteConfig

    mla = dict(kv_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=24, head_dim=16)
    return Glm4MoeLiteConfig(
        **WIDTH,
        **MLP_WIDTH,
        **MLA_HEADS,
        **mla,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"],
        moe_intermediate_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        rope_interleave=True,
    )


def _minicpm3():
    """MiniCPM3 shape: q-LoRA, the shared MLA dims, scaled embeddings and residual branches."""
    from transformers import MiniCPM3Config

    return MiniCPM3Config(
        **WIDTH,
        **MLP_WIDTH,
        **MLA_HEADS,
        **MLA_DIMS,
        head_dim=MLA_DIMS["qk_rope_head_dim"],
        num_hidden_layers=2,
        q_lora_rank=24,
    )


def _youtu():
    """Youtu-LLM shape: q-LoRA, value heads (12) narrower than nope (16), rotate-half RoPE."""
    from transformers import AutoConfig

    mla = dict(MLA_DIMS, v_head_dim=12)
    return AutoConfig.for_model(
        "youtu",
        **WIDTH,
        **MLP_WIDTH,
        **MLA_HEADS,
        **mla,
        head_dim=mla["qk_rope_head_dim"],
        num_hidden_layers=2,
        q_lora_rank=24,
        rope_interleave=False,
        **SMALL_TOKEN_IDS,
    )


ARCHS: dict = {
    "deepseek_v2": _deepseek_v2,
    "deepseek_v2_q_lora": _deepseek_v2_q_lora,
    "glm4_moe_lite": _glm4_moe_lite,
    "minicpm3": _minicpm3,
    "youtu": _youtu,
}
