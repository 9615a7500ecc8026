"""Gated-MLP matching (stage ``pattern_matcher``).

swiglu.py   match_swiglu_pattern
"""
