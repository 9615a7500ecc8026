"""Normalization matching (stage ``pattern_matcher``).

matchers.py   match_rmsnorm_pattern, match_l2norm_pattern
"""
