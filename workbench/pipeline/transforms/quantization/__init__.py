"""Quantization (stage ``pattern_matcher``): quantized checkpoints' and graphs' linears, BMMs,
MoE experts and gated MLPs become the canonical quantized ops (``workbench/ops/quant``).

    linear.py          quantize_fp8_linear_from_config, quantize_finegrained_fp8_linear_from_config,
                       quantize_nvfp4_linear_from_config, quantize_int4_linear_from_config,
                       quantize_int4_gptq_linear_from_config
    linear_formats.py  one class per linear format: the checkpoint tensors it needs, the op's arguments
    bmm.py             quantize_fp8_bmm_from_config
    from_graph.py      quantize_fp8_from_graph, quantize_nvfp4_from_graph
    moe.py             quantize_fp8_moe, quantize_finegrained_fp8_moe, quantize_nvfp4_moe
    moe_mxfp4.py       quantize_mxfp4_moe
    swiglu.py          match_nvfp4_swiglu_pattern, match_finegrained_fp8_swiglu_pattern
    graph.py           what they share: the config base, reading and replacing the graph's quantized tensors
"""
