"""Tiny random configs of more dense attention families (merged into ``workbench.models.tiny.TINY_ARCHS``).

Widely deployed families whose attention or MLP differs from Llama's in a way the pipeline has to
canonicalize; each passes ``workbench check`` (every attention layer cached, greedy tokens equal HF's):

* ``gpt2``: learned absolute positions, Conv1D (transposed) fused QKV, LayerNorm, GELU MLP, biases.
* ``gpt_bigcode``: StarCoder-1 / SantaCoder: multi-query attention (one K/V head) from a fused
  projection, learned absolute positions.
* ``gpt_neox``: Pythia / GPT-NeoX: fused per-head-interleaved QKV, partial rotary (a quarter of
  the head), parallel attention + MLP residual.
* ``gptj``: GPT-J: interleaved (even/odd pair) partial rotary on 8 of 16 dims, parallel block.
* ``codegen``: CodeGen: GPT-J's block with a fused QKV split in ``mp_num`` (4) model-parallel groups.
* ``opt``: OPT: learned positions with an offset of 2, ReLU MLP, biases.
* ``falcon_gqa``: Falcon-40B/180B ("new decoder architecture"): grouped-query attention from one
  fused projection laid out per KV group, two LayerNorms feeding parallel attention + MLP.
* ``persimmon``: Persimmon (Fuyu's backbone): LayerNorm QK-norm, partial rotary (half the head),
  squared-ReLU MLP, fused QKV.
* ``nemotron``: Nemotron-4 / Minitron: ``layernorm1p`` (weight + 1), partial rotary, squared ReLU.
* ``arcee``: Arcee AFM: an ungated squared-ReLU MLP in a Llama block.
* ``bitnet``: BitNet b1.58 (full-precision weights here): RMSNorm sub-norms inside attention (before
  ``o_proj``) and the MLP (before ``down_proj``), squared ReLU.
* ``ernie4_5``: ERNIE 4.5 dense: interleaved RoPE pairs on the whole head.
* ``hunyuan_v1_dense``: Hunyuan dense: QK-norm applied *after* RoPE.
* ``seed_oss``: Seed-OSS: Q/K/V biases in a Llama block.
* ``olmo3``: OLMo 3: a sliding-window and a full layer, QK-norm over the whole projection.
* ``gemma3n``: Gemma 3n's text stack: the last two layers reuse the K/V of the last earlier layer of
  the same type (KV sharing across layers), AltUp, LAuReL, per-layer token inputs, Gaussian top-k
  activation sparsity on the first layer, sliding and full layers (4 layers).

Shared sizes from ``sizes.py`` (hidden 64, vocab 512, 2 layers, 4 query / 2 KV heads of 16 where the
family has GQA, 4 heads where it is multi-head only). Weights: at transformers' default init (std
0.02, often a tied lm head) greedy decoding of these random models repeats one or two tokens, which
a cache that lost the past would reproduce too. Every config here therefore sets its own init std
(``ORACLE``: 0.3, or 0.2 where 0.3 falls short) and an untied lm head -- explicitly, so the configs
do not depend on what ``workbench.models.tiny`` gives builders that leave them at the defaults.
Checked (seed 0): HF's 16 greedy tokens on each ``workbench check`` prompt hold >= 8 distinct ids
(``tests/test_more_families.py`` asserts it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sizes import (
    COMMON,
    GQA_HEADS,
    HEAD_DIM,
    MLP_WIDTH,
    ORACLE,  # weights that make greedy decoding depend on the context (see the module docstring)
    SLIDING_THEN_FULL,
    SMALL_TOKEN_IDS,
    WIDTH,
)
from .spec import TinyConfig, tiny_config

#: The shared sizes in GPT-2 spelling (``n_embd`` / ``n_layer`` / ``n_head``), multi-head, without the
#: MLP width (OpenAI GPT has no such field, CTRL names it ``dff``) ...
GPT_SHAPE: dict = dict(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4)
#: ... and with it (``n_inner``).
GPT_SIZES: dict = dict(GPT_SHAPE, n_inner=128)
#: The shared sizes for families without GQA: 4 heads of 16 (head dim = hidden / heads).
MHA: dict = dict(WIDTH, **MLP_WIDTH, num_hidden_layers=2, num_attention_heads=4)


def oracle_config(family: str, *presets: Mapping[str, Any], attention: str | None = None, **fields: Any) -> TinyConfig:
    """``family``'s tiny config with the strong-oracle weights (``ORACLE``) and the small token ids, then
    its presets and fields (which may override either: ``initializer_range=0.2``)."""
    return tiny_config(family, ORACLE, SMALL_TOKEN_IDS, *presets, attention=attention, **fields)


ARCHS: dict = {
    "gpt2": oracle_config("GPT2Config", GPT_SIZES),
    "gpt_bigcode": oracle_config("GPTBigCodeConfig", GPT_SIZES, multi_query=True),
    # rope_parameters' default partial_rotary_factor is 0.25 (Pythia's rotary_pct).
    "gpt_neox": oracle_config("GPTNeoXConfig", MHA),
    "gptj": oracle_config("GPTJConfig", GPT_SIZES, rotary_dim=8, initializer_range=0.2),
    "codegen": oracle_config("CodeGenConfig", GPT_SIZES, n_ctx=512, rotary_dim=8),
    "opt": tiny_config(
        "OPTConfig",
        WIDTH,
        SMALL_TOKEN_IDS,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        init_std=0.2,  # OPT names its init std init_std.
        tie_word_embeddings=False,
    ),
    "falcon_gqa": oracle_config(
        "FalconConfig",
        WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        alibi=False,
        ffn_hidden_size=128,
    ),
    "persimmon": oracle_config("PersimmonConfig", MHA, qk_layernorm=True, initializer_range=0.2),
    "nemotron": oracle_config("NemotronConfig", COMMON),
    "arcee": oracle_config("ArceeConfig", COMMON, initializer_range=0.2),
    "bitnet": oracle_config("BitNetConfig", WIDTH, GQA_HEADS, MLP_WIDTH, num_hidden_layers=2),
    "ernie4_5": oracle_config("Ernie4_5Config", COMMON),
    "hunyuan_v1_dense": oracle_config("HunYuanDenseV1Config", COMMON),
    "seed_oss": oracle_config("SeedOssConfig", COMMON),
    "olmo3": oracle_config("Olmo3Config", WIDTH, GQA_HEADS, MLP_WIDTH, SLIDING_THEN_FULL, num_hidden_layers=2),
    "gemma3n": oracle_config(
        "Gemma3nTextConfig",
        WIDTH,
        GQA_HEADS,
        HEAD_DIM,
        MLP_WIDTH,
        num_hidden_layers=4,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,  # layers 2 and 3 reuse the K/V of layers 0 and 1 (same layer types)
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    ),
}
