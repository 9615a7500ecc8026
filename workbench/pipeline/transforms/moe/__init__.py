"""Mixture-of-experts matching (stage ``pattern_matcher``).

matchers.py        match_moe_pattern, match_dense_moe_pattern, match_bmm_moe_pattern,
                   split_moe_fused_for_sharding, match_moe_routing_pattern
biased_experts.py  gpt-oss's biased, transposed, clamped-SwiGLU experts (patterns of match_moe_pattern)
expert_loop.py     the MoE written as a loop over experts (Mixtral's classic block) -> torch_moe
"""
