"""Attention matching (stage ``pattern_matcher``): SDPA, eager softmax attention, repeat-KV and
layouts become the canonical ``torch_attention``.

    matchers.py   match_repeat_kv, match_eager_attention, match_sdpa_to_torch_attention, match_grouped_attention
    layout.py     match_attention_layout, match_rope_layout, eliminate_redundant_transposes
    masks.py      reading HF's attention-mask constructions (causal, sliding window) for the matchers
    alibi.py      ALiBi's spellings (BLOOM, MPT, Falcon eager and SDPA) for match_eager_attention / match_sdpa_to_torch_attention
"""
