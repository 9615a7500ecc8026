"""Attention matching (stage ``pattern_matcher``): SDPA, eager softmax attention, repeat-KV and
layouts become the canonical ``torch_attention``. What a mask encodes is read by
``pipeline/matcher/masks.py`` (shared with ``insert_cached_attention``, which classifies masks again once
the weights are loaded).

    matchers.py      the chain in pipeline order; match_sdpa_to_torch_attention
    repeat_kv.py     match_repeat_kv, match_grouped_attention
    eager.py         match_eager_attention: eager attention and its soft-capped / sink variants
    variants.py      what the patterns share: the q/k/v and mask check, the replacement, the SDPA spelling
    layout.py        match_attention_layout, match_rope_layout, eliminate_redundant_transposes
    legacy.py        older eager spellings: logits replaced through a registered causal table (GPT-Neo, OpenAI GPT)
    bmm_heads.py     eager attention over heads folded into the batch (XGLM, BART-style decoders)
    alibi.py         ALiBi's spellings (BLOOM, MPT, Falcon eager and SDPA) for match_eager_attention / match_sdpa_to_torch_attention
    alibi_slopes.py  ALiBi's slopes read off the position terms and held as a graph constant
"""
