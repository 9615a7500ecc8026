"""Tiny random configs of more mixture-of-experts families (merged into ``workbench.models.tiny.TINY_ARCHS``).

Widely deployed MoE families, one per routing / expert layout the pipeline has to run; each passes
``workbench check`` (every attention layer cached, greedy tokens equal HF's):

* ``olmoe``: OLMoE: softmax top-k routing, QK-norm over the whole Q / K projection.
* ``granitemoe``: Granite 3 MoE: muP multipliers (embedding, residual, attention, logits) around a
  top-k MoE.
* ``granitemoeshared``: PowerMoE / Granite shared-expert MoE: the same plus a shared MLP on every token.
* ``phimoe``: Phi-3.5-MoE: sparse-mixer routing (top-2 picked by masked softmaxes, no renormalization).
* ``qwen2_moe``: Qwen1.5/2-MoE: softmax top-k without renormalization plus a sigmoid-gated shared expert.
* ``glm4_moe``: GLM-4.5/4.6: sigmoid scores with a bias correction for the choice only, group-limited
  selection (2 groups, 1 kept), a shared expert, a dense first layer, QK-norm, partial rotary.
* ``dots1``: dots.llm1: the same DeepSeek-V3-style routing (one group), shared expert, dense first layer.
* ``ernie4_5_moe``: ERNIE 4.5 MoE: softmax scores with a bias correction (``moe_statics``) for the
  choice, min-normalized weights, a shared expert, a dense first layer, interleaved RoPE.
* ``hunyuan_v1_moe``: Hunyuan MoE: softmax top-k plus a shared MLP, QK-norm after RoPE.
* ``minimax_m2``: MiniMax-M2: sigmoid routing with a correction bias, QK-norm over the whole projection.
* ``dbrx``: DBRX: experts that loop over the experts that received tokens, weights flat ``[E * I, H]``
  (``canonical_expert_loop``), clipped QKV, fused Wqkv.
* ``longcat_flash``: LongCat-Flash: the same loop with stacked weights plus 2 identity ("zero")
  experts the router may pick, MLA attention (another q-LoRA / rope split), two attention and MLP
  sub-blocks per layer with a shortcut MoE.

Shared sizes as in ``workbench.models.tiny``: hidden 64, vocab 512, 2 layers, 4 query / 2 KV heads of
16; 4 routed experts, top-2, expert width 64 (shared experts 64 wide too). Weights as in ``more_dense``
(``ORACLE``: init std 0.3 -- 0.1 for the Granite MoEs --, untied lm head, set explicitly): checked (seed 0), HF's 16 greedy tokens on
each ``workbench check`` prompt hold >= 8 distinct ids.
"""

from __future__ import annotations

from .more_dense import oracle_config
from .sizes import (
    COMMON,
    DEEPSEEK_MOE,
    EXPERT_WIDTH,
    MLA_HEADS,
    MUP,
    ORACLE_STD_0_1,
    QWEN_MOE,
    TOP2,
    WIDE_ROPE_MLA_DIMS,
    WIDTH,
)

#: The shared sizes for families whose experts take ``intermediate_size`` (no separate MoE width).
MOE_COMMON: dict = {**COMMON, "intermediate_size": 64}
#: DeepSeek-V3-style routing (sigmoid + choice bias), 4 routed experts and 1 shared, first layer dense.
V3_ROUTING: dict = dict(DEEPSEEK_MOE, first_k_dense_replace=1)
#: What Granite's MoE families share besides their sizes: 4 experts, top-2, the muP multipliers (as
#: ``tiny:granite`` has them), init std 0.1 (``ORACLE_STD_0_1``): at 0.3 the cached decode's logits drift
#: from a full re-forward by just over ``test_generate``'s 1e-5 RMSE (the tokens still equal HF's); 0.1
#: keeps >= 12 distinct tokens.
GRANITE_MOE: dict = dict(num_local_experts=4, **TOP2, **MUP, **ORACLE_STD_0_1)

ARCHS: dict = {
    "olmoe": oracle_config("OlmoeConfig", MOE_COMMON, TOP2, num_experts=4),
    "granitemoe": oracle_config("GraniteMoeConfig", MOE_COMMON, GRANITE_MOE),
    "granitemoeshared": oracle_config("GraniteMoeSharedConfig", MOE_COMMON, GRANITE_MOE, shared_intermediate_size=64),
    "phimoe": oracle_config("PhimoeConfig", MOE_COMMON, TOP2, num_local_experts=4),
    "qwen2_moe": oracle_config("Qwen2MoeConfig", COMMON, QWEN_MOE, shared_expert_intermediate_size=64),
    "glm4_moe": oracle_config("Glm4MoeConfig", COMMON, V3_ROUTING, n_group=2, topk_group=1, use_qk_norm=True),
    "dots1": oracle_config("Dots1Config", COMMON, V3_ROUTING, n_group=1, topk_group=1),
    "ernie4_5_moe": oracle_config(
        "Ernie4_5_MoeConfig",
        COMMON,
        EXPERT_WIDTH,
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    "hunyuan_v1_moe": oracle_config("HunYuanMoEV1Config", MOE_COMMON, num_experts=4, moe_topk=2),
    "minimax_m2": oracle_config("MiniMaxM2Config", MOE_COMMON, TOP2, num_local_experts=4),
    "dbrx": oracle_config(
        "DbrxConfig",
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=512,
        vocab_size=512,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2, ffn_act_fn={"name": "silu"}),
    ),
    "longcat_flash": oracle_config(
        "longcat_flash",
        WIDTH,
        MLA_HEADS,
        WIDE_ROPE_MLA_DIMS,  # GLM-4.7-Flash's MLA dims (``mla.GLM4_MOE_LITE_MLA``), with q-LoRA
        num_layers=2,
        ffn_hidden_size=128,
        q_lora_rank=24,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        expert_ffn_hidden_size=64,
    ),
}
