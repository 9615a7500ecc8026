"""Mixture-of-experts matching (stage ``pattern_matcher``).

matchers.py            match_moe_pattern: transformers' stacked experts (grouped_mm / batched_mm) -> torch_moe_fused
biased_experts.py      gpt-oss's biased, transposed, clamped-SwiGLU experts (patterns of match_moe_pattern)
grouped_mm.py          what the stacked-experts patterns share: the grouped_mm op, the token sort around it
expert_loop.py         the MoE written as a loop over experts (Mixtral's classic block) -> torch_moe
dense_experts.py       match_bmm_moe_pattern, match_dense_moe_pattern: all-experts BMMs -> torch_moe_dense_mlp
routing.py             match_moe_routing_pattern: softmax -> top-k -> renormalise as one op
split_for_sharding.py  split_moe_fused_for_sharding: torch_moe_fused -> torch_moe with per-expert lists
"""
