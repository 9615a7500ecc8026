"""The declarative pattern matcher: ``Pattern`` (search/replace as eager functions), ``PatternMatcher``
(backtracking match over exported ATen graphs), and the rewrite helpers transforms share.

``pattern``: patterns and their traced graphs; ``engine``: matching and applying a match;
``rewrite``: recording replacements (provenance, fake values) for the matcher and for transforms
that rewrite by hand;
``trace``: the tracer patterns and tests use (the pipeline's own); ``masks``: what an attention mask
encodes (causal, sliding window, chunked), for the attention matchers and the cache stage.
"""

from .engine import COMMUTATIVE, Match, PatternMatcher, PatternTransform, named_args, replace_match
from .fake_values import fake_call
from .pattern import EVAL_DROPOUT, Pattern, traced_pattern
from .rewrite import (
    annotate_new_nodes,
    erase_dead,
    inserted_between,
    match_info,
    propagate_fake_values,
    refresh_after_rewrite,
    repropagate_users,
    same_shape,
    same_size,
)
from .trace import automatic_dims, export_graph_module

__all__ = [
    "fake_call",
    "COMMUTATIVE",
    "EVAL_DROPOUT",
    "Match",
    "Pattern",
    "PatternMatcher",
    "PatternTransform",
    "named_args",
    "traced_pattern",
    "annotate_new_nodes",
    "erase_dead",
    "inserted_between",
    "match_info",
    "propagate_fake_values",
    "refresh_after_rewrite",
    "replace_match",
    "repropagate_users",
    "same_shape",
    "same_size",
    "automatic_dims",
    "export_graph_module",
]
