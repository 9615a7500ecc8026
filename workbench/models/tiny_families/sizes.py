"""The sizes the tiny families share, in one place (``workbench.models.tiny`` explains the choice).

Small tables that families combine with their own fields, so a size changes for every family at
once and each builder spells only what is particular to it.
"""

from __future__ import annotations

#: Model width, vocabulary and positions of every tiny model.
WIDTH: dict = dict(hidden_size=64, vocab_size=512, max_position_embeddings=512)
#: Special-token ids inside the tiny vocabulary, for configs whose defaults (ids of 50k-250k-token
#: vocabularies) lie outside it.
SMALL_TOKEN_IDS: dict = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: Attention heads: 4 query / 2 KV (GQA) ...
GQA_HEADS: dict = dict(num_attention_heads=4, num_key_value_heads=2)
#: ... of 16 channels (set explicitly: not every family derives it from hidden / heads).
HEAD_DIM: dict = dict(head_dim=16)
#: The dense MLP's intermediate width.
MLP_WIDTH: dict = dict(intermediate_size=128)
#: A transformer stack without its layer count (hybrids choose their own).
TRANSFORMER: dict = dict(**WIDTH, **GQA_HEADS, **HEAD_DIM, **MLP_WIDTH)
#: The plain families: the transformer stack, 2 layers.
COMMON: dict = dict(TRANSFORMER, num_hidden_layers=2)

#: The linear-attention hybrids' four layers: a linear (recurrent) mixer then full attention, twice.
LINEAR_THEN_FULL_TWICE: dict = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)

#: One sliding-window layer (window ``WINDOW``: shorter than the check prompts, so a window layer
#: differs from a full one) then one full layer.
WINDOW = 4
SLIDING_THEN_FULL: dict = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])

#: Multi-head latent attention: 4 heads (K/V come from one shared latent), every MLA dim distinct.
MLA_HEADS: dict = dict(num_attention_heads=4, num_key_value_heads=4)
MLA_DIMS: dict = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
#: MLA with rope wider than nope: rope 16 | nope 8 | value 24, latent rank 24, rotary ``head_dim`` = rope
#: (GLM-4.7-Flash without q-LoRA, LongCat-Flash with it).
WIDE_ROPE_MLA_DIMS: dict = dict(kv_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=24, head_dim=16)

#: Top-2 routing.
TOP2: dict = dict(num_experts_per_tok=2)
#: Expert width (families with a separate MoE width).
EXPERT_WIDTH: dict = dict(moe_intermediate_size=64)
#: Mixture of experts in Qwen's spelling: 4 experts of width 64, top-2 (no shared expert).
QWEN_MOE: dict = dict(num_experts=4, **TOP2, **EXPERT_WIDTH)
#: Mixture of experts in DeepSeek's spelling: 4 routed experts of width 64, top-2, 1 shared expert.
DEEPSEEK_MOE: dict = dict(EXPERT_WIDTH, n_routed_experts=4, **TOP2, n_shared_experts=1)

#: muP multipliers (Granite, HyperCLOVA X), away from 1 so each is exercised: the attention multiplier is
#: the softmax scale, the embedding / residual / logit multipliers around it.
MUP: dict = dict(attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)

#: The weights' init std of the strong-oracle configs (``workbench.models.tiny`` explains the choice).
TINY_INIT_STD = 0.3
#: Weights that make greedy decoding depend on the context: init std ``TINY_INIT_STD``, an lm head of
#: its own (``tiny.ORACLE_DEFAULTS`` and the families' ``oracle_config``).
ORACLE: dict = dict(initializer_range=TINY_INIT_STD, tie_word_embeddings=False)
#: ``ORACLE`` at init std 0.1, for families whose cached decode drifts at 0.3 (Granite's MoEs, MiniMax:
#: each says why where it uses it).
ORACLE_STD_0_1: dict = {**ORACLE, "initializer_range": 0.1}
