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

from .sizes import DEEPSEEK_MOE, MLA_DIMS, MLA_HEADS, MLP_WIDTH, SMALL_TOKEN_IDS, WIDE_ROPE_MLA_DIMS, WIDTH
from .spec import tiny_config

#: The MLA sizes shared by both variants (see the module docstring).
MLA_SIZES: dict = dict(
    **WIDTH,
    **MLP_WIDTH,
    **MLA_HEADS,
    **MLA_DIMS,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    **DEEPSEEK_MOE,  # DeepSeek-V2's MoE at toy size: 4 routed experts (top-2, greedy) and 1 shared expert
    topk_method="greedy",
)


#: GLM-4.7-Flash's MLA: no q-LoRA, rope 16 | nope 8 | value 24, latent rank 24 (rotary ``head_dim`` = rope).
GLM4_MOE_LITE_MLA: dict = dict(WIDE_ROPE_MLA_DIMS, q_lora_rank=None)
#: Youtu's MLA: the shared dims with value heads (12) narrower than nope (16).
YOUTU_MLA: dict = dict(MLA_DIMS, v_head_dim=12)
#: The dense families' MLA stack: the shared sizes, q-LoRA of rank 24, rotary ``head_dim`` = rope.
DENSE_MLA: dict = dict(
    WIDTH,
    **MLP_WIDTH,
    **MLA_HEADS,
    **MLA_DIMS,
    head_dim=MLA_DIMS["qk_rope_head_dim"],
    num_hidden_layers=2,
    q_lora_rank=24,
)

ARCHS: dict = {
    # DeepSeek-V2(-Lite) shape: queries through one full projection (``q_lora_rank=None``).
    "deepseek_v2": tiny_config("DeepseekV2Config", MLA_SIZES, q_lora_rank=None),
    # DeepSeek-V2 (full) shape: queries through a low-rank ``q_a_proj -> RMSNorm -> q_b_proj`` too.
    "deepseek_v2_q_lora": tiny_config("DeepseekV2Config", MLA_SIZES, q_lora_rank=24),
    # GLM-4.7-Flash shape: interleaved RoPE, DeepSeek-V2's MoE after a dense layer.
    "glm4_moe_lite": tiny_config(
        "Glm4MoeLiteConfig",
        WIDTH,
        MLP_WIDTH,
        MLA_HEADS,
        GLM4_MOE_LITE_MLA,
        DEEPSEEK_MOE,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"],
        n_group=1,
        topk_group=1,
        rope_interleave=True,
    ),
    # MiniCPM3 shape: q-LoRA, the shared MLA dims, scaled embeddings and residual branches.
    "minicpm3": tiny_config("MiniCPM3Config", DENSE_MLA),
    # Youtu-LLM shape: q-LoRA, value heads (12) narrower than nope (16), rotate-half RoPE.
    "youtu": tiny_config("youtu", DENSE_MLA, YOUTU_MLA, rope_interleave=False, **SMALL_TOKEN_IDS),
}
