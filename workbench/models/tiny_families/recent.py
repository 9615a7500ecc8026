"""Tiny random configs of recent decoder-only families (merged into ``workbench.models.tiny.TINY_ARCHS``).

Families released in 2025-26 that people deploy, each run by the default pipeline with no change to
it: every attention layer cached, greedy tokens equal HF's (``tests/test_more_families.py``,
``workbench check``). What each puts in front of the pattern matcher:

* ``ministral``: Ministral 8B: sliding-window and full layers alternating (window 4 here).
* ``ministral3``: Ministral 3 / Mistral 3: YaRN-scaled RoPE with Llama-4-style query scaling by
  position (``llama_4_scaling_beta``).
* ``hyperclovax``: HyperCLOVA X: muP multipliers (embedding, residual, attention, logits) and
  post-norms after attention and MLP.
* ``cwm``: Meta CWM: Llama-3 RoPE scaling, a full layer then sliding-window layers (window 4 here).
* ``diffllama``: DiffLlama: differential attention -- two attention maps per head, the second
  subtracted with a learned lambda, a group norm on the result.
* ``jetmoe``: JetMoE: mixture of attention heads (MoA: routed query/output projections around shared
  K/V) beside an MoE MLP.
* ``exaone_moe``: EXAONE MoE: routed experts with a shared expert and a dense first layer, QK-norm,
  sliding and full attention layers.
* ``flex_olmo``: FlexOlmo: OLMo-2 post-norms and QK-norm around a top-k MoE without renormalization.
* ``solar_open``: Solar Open: DeepSeek-V3-style routing (one group) and a shared expert.
* ``hy_v3``: Hunyuan v3: a dense first layer, then routed experts (scaled by a router factor) with a
  shared expert; QK-norm.
* ``afmoe``: Arcee Trinity (AFMoE): token-choice routing with a shared expert, a dense first layer,
  an output gate on attention (``gate_proj``), QK-norm, four norms per block, sliding and full layers.
* ``laguna``: Poolside Laguna: a softplus output gate per attention head, routed and shared experts.
* ``vaultgemma``: VaultGemma: a Gemma-2 block (attention-logit and final-logit soft-capping, a query
  pre-attention scalar, sliding and full layers with window 4 here) in eager attention only: HF has
  no SDPA path for it, so the eager spelling is what the matcher sees.
* ``mimo_v2_flash``: Xiaomi MiMo-V2-Flash: attention layers of two shapes -- full attention, then
  sliding-window attention with twice the KV heads and a learned sink logit per head --, query/key
  heads 16 wide against value heads 8 wide, values scaled, the softmax after a row-max subtraction
  (eager only: HF has no SDPA path); MoE after a dense first layer.
* ``granite_swa`` / ``granitemoe_swa``: Granite with sliding-window layers and a learned sink per
  head applied after the attention as ``out * sigmoid(logsumexp(logits) - sink)`` (eager only), muP
  attention multiplier; the MoE variant with 4 experts.
* ``apertus``: Apertus: an ungated MLP with the xIELU activation, whose constants only its
  constructor sets (the random build takes them from an ordinary build, ``models/build.py``),
  QK-norm, Llama-3 RoPE scaling; 3 layers (with 2, HF's greedy tokens repeat on one check prompt).

Sizes as in ``more_dense`` / ``more_moe`` (hidden 64, vocab 512, 2 layers, 4 query / 2 KV heads of
16; 4 routed experts -- 8 for ``flex_olmo`` --, top-2, expert width 64) and the same strong-oracle weights (``ORACLE``: init std
0.3, untied lm head). Checked (seed 0, transformers 5.23): HF's 16 greedy tokens on each
``workbench check`` prompt hold >= 8 distinct ids.
"""

from __future__ import annotations

from typing import Any

from .more_dense import oracle_config
from .sizes import COMMON, DEEPSEEK_MOE, EXPERT_WIDTH, MUP, QWEN_MOE, SLIDING_THEN_FULL, TOP2
from .spec import TinyConfig

#: Granite's sliding-window variants: muP attention multiplier (the sinks are the family's own).
GRANITE_SWA: dict = dict(SLIDING_THEN_FULL, attention_multiplier=0.25)


def _recent(model_type: str, **fields: Any) -> TinyConfig:
    """The family's config (by model type: the classes' names vary) with the shared sizes."""
    return oracle_config(model_type, COMMON, **fields)


ARCHS: dict = {
    "ministral": _recent("ministral", **SLIDING_THEN_FULL),
    "ministral3": _recent("ministral3"),
    # the muP multipliers away from 1, so each is exercised (as tiny:granite has them)
    "hyperclovax": _recent("hyperclovax", **MUP),
    "cwm": _recent("cwm", sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
    "diffllama": _recent("diffllama"),
    # MoA: query heads = KV heads x experts per token; 4 experts, top-2, for attention heads and MLP
    "jetmoe": _recent("jetmoe", num_local_experts=4, **TOP2, kv_channels=16),
    "exaone_moe": _recent(
        "exaone_moe",
        **QWEN_MOE,
        num_shared_experts=1,
        first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse"],
        **SLIDING_THEN_FULL,
    ),
    # 8 experts: with 4 (top-2) HF's greedy tokens repeat on one check prompt (6 distinct of 16)
    "flex_olmo": _recent("flex_olmo", num_experts=8, **TOP2),
    "solar_open": _recent("solar_open", **DEEPSEEK_MOE),
    "hy_v3": _recent("hy_v3", **QWEN_MOE, num_shared_experts=1, mlp_layer_types=["dense", "sparse"]),
    "afmoe": _recent("afmoe", **QWEN_MOE, num_shared_experts=1, num_dense_layers=1, **SLIDING_THEN_FULL),
    "laguna": _recent("laguna", **QWEN_MOE, shared_expert_intermediate_size=64, mlp_layer_types=["dense", "sparse"]),
    "apertus": _recent("apertus", num_hidden_layers=3),
    "vaultgemma": _recent("vaultgemma", query_pre_attn_scalar=16, **SLIDING_THEN_FULL),
    "mimo_v2_flash": _recent(
        "mimo_v2_flash",
        v_head_dim=8,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
        mlp_layer_types=["dense", "sparse"],
        n_routed_experts=4,
        **TOP2,
        **EXPERT_WIDTH,
        attention_value_scale=0.707,
    ),
    "granite_swa": _recent("granite_swa", **GRANITE_SWA),
    "granitemoe_swa": _recent("granitemoe_swa", **GRANITE_SWA, num_local_experts=4, **TOP2, intermediate_size=64),
}
