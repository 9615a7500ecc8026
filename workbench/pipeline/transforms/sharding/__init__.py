"""Sharding (stage ``sharding``): a plan of which regions split how across ranks, then the rewrite.

transforms.py   detect_sharding, sharding_transform_executor
plans.py        detect_plan / apply_plan, the two entry points
detect.py       Detector: runs the region finders below in the order they claim nodes, collects the plan
detect_attention.py  the attention regions (split by heads)
detect_mlp.py   the MoE (experts), LM-head (vocabulary) and MLP (features) regions
detect_cuts.py  what the region finders share: column / row cuts, region bytes, NotShardable
plan.py         the plan's types (regions, cuts, ranges)
apply.py        the rewrite: sliced weights, collectives
linear_ops.py   the linear ops a region may hold (plain and quantized)
hint_transform.py  apply_sharding_hints: the opt-in alternative for sharding-aware models
hints.py        its rewrite: each torch_hint_* node cut for one rank and lowered to the plain op
"""
