"""RoPE matching (stage ``pattern_matcher``).

matchers.py   match_rope_pattern
"""
