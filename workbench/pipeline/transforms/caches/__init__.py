"""Cache initialization (stage ``cache_init``): cached attention and per-sequence state, their inputs,
and the allocation of the caches.

    attention.py           insert_cached_attention
    attention_backend.py   the attention backend choice (``auto``: the first that runs and serves every layer)
    mla.py                 insert_cached_mla_attention
    state.py               insert_cached_ssm_attention, insert_cached_causal_conv, insert_cached_delta_rule,
                           insert_cached_gated_delta_rule
    state_rewrite.py       the one rewrite every stateful op shares (``ops/state.py`` declares them)
    mrope_delta.py         initialize_mrope_delta_cache
    residual_add.py        insert_cached_residual_add
    hidden_states.py       detect_hidden_states_for_capture
    gather_logits.py       gather_logits_before_lm_head
    alloc.py               initialize_cache, resize_kv_cache
    memory.py              the limits against free memory, before allocating: bytes, what to lower
    fit.py                 the same check when a Workbench is built (K/V bytes estimated from the config)
    transformers_mode.py   detect_hf_attn_layers, transformers_replace_cached_attn (the HF model, no export)
    inputs.py              the graph inputs the cache transforms add (metadata, caches, slots)
"""
