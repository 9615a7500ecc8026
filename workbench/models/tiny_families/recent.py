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

from .more_dense import ORACLE
from .sizes import COMMON, SMALL_TOKEN_IDS

#: 4 routed experts, top-2, 64 wide, one shared expert.
SMALL_MOE: dict = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
#: One sliding-window layer (window 4: shorter than the check prompts) then one full layer.
SLIDING_THEN_FULL: dict = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _config(model_type: str, **fields: Any):
    """The family's config class (by model type: the classes' names vary) with the shared sizes."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **ORACLE, **SMALL_TOKEN_IDS, **fields})


def _ministral():
    return _config("ministral", **SLIDING_THEN_FULL)


def _ministral3():
    return _config("ministral3")


def _hyperclovax():
    # the muP multipliers away from 1, so each is exercised (as tiny:granite has them)
    mup = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)
    return _config("hyperclovax", **mup)


def _cwm():
    return _config("cwm", sliding_window=4, layer_types=["full_attention", "sliding_attention"])


def _diffllama():
    return _config("diffllama")


def _jetmoe():
    # MoA: query heads = KV heads x experts per token; 4 experts, top-2, for attention heads and MLP
    return _config("jetmoe", num_local_experts=4, num_experts_per_tok=2, kv_channels=16)


def _exaone_moe():
    return _config(
        "exaone_moe",
        **SMALL_MOE,
        num_shared_experts=1,
        first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse"],
        **SLIDING_THEN_FULL,
    )


def _flex_olmo():
    # 8 experts: with 4 (top-2) HF's greedy tokens repeat on one check prompt (6 distinct of 16)
    return _config("flex_olmo", num_experts=8, num_experts_per_tok=2)


def _solar_open():
    return _config(
        "solar_open", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1
    )


def _hy_v3():
    return _config("hy_v3", **SMALL_MOE, num_shared_experts=1, mlp_layer_types=["dense", "sparse"])


def _laguna():
    return _config("laguna", **SMALL_MOE, shared_expert_intermediate_size=64, mlp_layer_types=["dense", "sparse"])


def _vaultgemma():
    return _config("vaultgemma", query_pre_attn_scalar=16, **SLIDING_THEN_FULL)


def _mimo_v2_flash():
    return _config(
        "mimo_v2_flash",
        v_head_dim=8,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
        mlp_layer_types=["dense", "sparse"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        attention_value_scale=0.707,
    )


def _granite_swa(model_type: str = "granite_swa", **fields: Any):
    return _config(model_type, **SLIDING_THEN_FULL, attention_multiplier=0.25, **fields)


def _granitemoe_swa():
    return _granite_swa("granitemoe_swa", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)


def _apertus():
    return _config("apertus", num_hidden_layers=3)


def _afmoe():
    return _config("afmoe", **SMALL_MOE, num_shared_experts=1, num_dense_layers=1, **SLIDING_THEN_FULL)


ARCHS: dict = {
    "ministral": _ministral,
    "ministral3": _ministral3,
    "hyperclovax": _hyperclovax,
    "cwm": _cwm,
    "diffllama": _diffllama,
    "jetmoe": _jetmoe,
    "exaone_moe": _exaone_moe,
    "flex_olmo": _flex_olmo,
    "solar_open": _solar_open,
    "hy_v3": _hy_v3,
    "afmoe": _afmoe,
    "laguna": _laguna,
    "apertus": _apertus,
    "vaultgemma": _vaultgemma,
    "mimo_v2_flash": _mimo_v2_flash,
    "granite_swa": _granite_swa,
    "granitemoe_swa": _granitemoe_swa,
}
