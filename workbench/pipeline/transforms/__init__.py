"""Transform families, one module each; importing this package registers every transform.

    module              keys
    export              export_to_gm
    cleanup             cleanup_noop_slice, cleanup_noop_add, cleanup_input_constraints,
                        cleanup_identity_dtype_cast
    moe                 match_moe_pattern, match_dense_moe_pattern, match_bmm_moe_pattern,
                        split_moe_fused_for_sharding, match_moe_routing_pattern
    attention           match_repeat_kv, match_eager_attention, match_sdpa_to_torch_attention,
                        match_grouped_attention
    layout              match_attention_layout, match_rope_layout, eliminate_redundant_transposes
    rope                match_rope_pattern
    norms               match_rmsnorm_pattern, match_l2norm_pattern
    swiglu              match_swiglu_pattern
    quantization        quantize_fp8_linear_from_config, quantize_finegrained_fp8_linear_from_config,
                        quantize_nvfp4_linear_from_config, quantize_int4_linear_from_config,
                        quantize_int4_gptq_linear_from_config
    quantize_bmm        quantize_fp8_bmm_from_config
    quantize_from_graph quantize_fp8_from_graph, quantize_nvfp4_from_graph
    quantize_moe        quantize_fp8_moe, quantize_finegrained_fp8_moe, quantize_nvfp4_moe, quantize_mxfp4_moe
    quant_swiglu        match_nvfp4_swiglu_pattern, match_finegrained_fp8_swiglu_pattern
    hidden_states       detect_hidden_states_for_capture
    sharding            detect_sharding, sharding_transform_executor
    load_weights        load_weights
    fuse_gemms          fuse_gemms
    fuse_kernels        fuse_rmsnorm, fuse_rope, fuse_swiglu
    linear_layout       linear_weight_layout
    cached_attention    insert_cached_attention
    cached_mla          insert_cached_mla_attention
    state_caches        insert_cached_ssm_attention, insert_cached_causal_conv, insert_cached_delta_rule,
                        insert_cached_gated_delta_rule
    mrope_delta_cache   initialize_mrope_delta_cache
    cached_residual_add insert_cached_residual_add
    gather_logits       gather_logits_before_lm_head
    cache_alloc         initialize_cache, resize_kv_cache
    transformers_mode   detect_hf_attn_layers, transformers_replace_cached_attn
    fuse_causal_conv    fuse_causal_conv_activation
    multi_stream        multi_stream_moe, multi_stream_mla_attn, multi_stream_gemm
    compile_model       compile_model

``workbench transforms`` prints the same table from the registry. The framework helpers the
families share live beside this package: ``attention_masks`` (reading HF's mask constructions for
the attention matchers), ``matcher/`` (patterns), ``graph_utils``, ``graph_copy``,
``graph_weights``, ``weights``, ``cache_inputs``, ``cuda_only``; the quantization families share
``pipeline/quant_graph.py`` (a framework helper, so no family imports another).
"""

from . import attention, cleanup, export, hidden_states, layout, moe, norms, rope, swiglu  # noqa: F401
from . import quant_swiglu, quantization, quantize_bmm, quantize_from_graph, quantize_moe  # noqa: F401
from . import sharding  # noqa: F401
from . import load_weights  # noqa: F401
from . import fuse_causal_conv, fuse_gemms, fuse_kernels, linear_layout, multi_stream  # noqa: F401
from . import cache_alloc, cached_attention, cached_residual_add, gather_logits, transformers_mode  # noqa: F401
from . import cached_mla, mrope_delta_cache, state_caches  # noqa: F401
from . import compile_model  # noqa: F401
