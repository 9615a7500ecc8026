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

#: Multi-head latent attention: 4 heads (K/V come from one shared latent), every MLA dim distinct.
MLA_HEADS: dict = dict(num_attention_heads=4, num_key_value_heads=4)
MLA_DIMS: dict = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
#: Mixture of experts in DeepSeek's spelling: 4 routed experts of width 64, top-2, 1 shared expert.
DEEPSEEK_MOE: dict = dict(moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
