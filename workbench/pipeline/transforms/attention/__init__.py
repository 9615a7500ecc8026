"""Attention matching (stage ``pattern_matcher``): SDPA, eager softmax attention, repeat-KV and
layouts become the canonical ``torch_attention``. What a mask encodes is read by
``pipeline/matcher/masks.py`` (shared with ``insert_cached_attention``, which classifies masks again once
the weights are loaded).

    matchers.py   match_repeat_kv, match_eager_attention, match_sdpa_to_torch_attention, match_grouped_attention
    layout.py     match_attention_layout, match_rope_layout, eliminate_redundant_transposes
    legacy.py     older eager spellings: logits replaced through a registered causal table (GPT-Neo, OpenAI GPT)
    alibi.py      ALiBi's spellings (BLOOM, MPT, Falcon eager and SDPA) for match_eager_attention / match_sdpa_to_torch_attention
"""
