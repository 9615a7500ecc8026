"""Mixture-of-experts patterns (stage ``pattern_matcher``): the stacked experts -> ``torch_moe_fused``.

``match_moe_pattern``: HF transformers>=5 stacked experts -> ``torch_moe_fused`` (gpt-oss's biased,
transposed, interleaved clamped-SwiGLU experts too: ``biased_experts.py``); Mixtral's classic loop
over ``nn.Linear`` experts (``one_hot`` mask, ``torch.where``, ``index_add_``) -> ``torch_moe``
(``expert_loop.py``). Export spells the experts' forward by ``config._experts_implementation``:
``grouped_mm`` (sort tokens by expert, ``transformers::grouped_mm_fallback`` twice, un-permute, sum
over top-k: ``grouped_mm.py``) or ``batched_mm`` (gather each token's expert weights, ``bmm``).
``eager`` loops over the experts that received tokens, a data-dependent loop that does not export
at all.

The family's other forms: the dense / BMM all-experts MoE (``dense_experts.py``), the router's
softmax -> top-k (``routing.py``), and ``torch_moe_fused`` split into per-expert lists for sharding
(``split_for_sharding.py``).

The router (gate linear, softmax, top-k) stays outside the MoE op: the op takes the selected
experts and their weights, so routing variants (renormalised or not, sigmoid, grouped) need no
new MoE op, and ``match_moe_routing_pattern`` can fuse the common router separately.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import tensor_meta
from ...interface import TransformInfo, register
from ...matcher import Match, Pattern, PatternMatcher, PatternTransform, match_info, same_shape
from .biased_experts import biased_expert_patterns
from .expert_loop import replace_expert_loops
from .grouped_mm import EXPERT_SIZE_ARGS, grouped_mm_op, sort_by_expert, unsort_by_expert

aten = torch.ops.aten
wb = torch.ops.workbench

# Example sizes (and sentinels) for tracing: T tokens, H hidden, I intermediate, E experts, k top-k.
_T, _H, _I, _E, _K = 5, 8, 6, 7, 3


def _moe_examples():
    selected = torch.stack([torch.randperm(_E)[:_K] for _ in range(_T)])
    return (torch.randn(_T, _H), selected, torch.rand(_T, _K), torch.randn(_E, 2 * _I, _H), torch.randn(_E, _H, _I))


def _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel: bool):
    # transformers' grouped_mm experts forward (gated, weights [E, out, in], no bias): sort the
    # (token, slot) pairs by expert, one grouped GEMM per projection, un-permute, sum over top-k.
    # ``sentinel``: as transformers 5.17 writes it, with an expert-parallel "sentinel" mask (ids >= E)
    # built and applied whether or not experts are sharded -- zeroed input rows and zeroed rows
    # after each grouped GEMM; with E experts no id reaches E, so it masks nothing. Its in-place
    # clamp of the ids is read by nothing without biases, but export keeps it (a mutation): it is
    # returned, to be a second output of the pattern rather than an outside user of the sorted ids.
    mm = grouped_mm_op()
    rows = sort_by_expert(x, selected, weights, k, _E, sentinel)
    h = mm(rows.xs.to(w1_w3.dtype), w1_w3.transpose(-2, -1), rows.offsets)
    h = h.masked_fill(rows.mask, 0.0) if sentinel else h
    gate, up = h.chunk(2, dim=-1)
    y = mm((F.silu(gate) * up).to(w2.dtype), w2.transpose(-2, -1), rows.offsets)
    y = y.masked_fill(rows.mask, 0.0) if sentinel else y
    return unsort_by_expert(y, rows, x, k), rows.clamped


def _moe_grouped_mm(x, selected, weights, w1_w3, w2, *, k):
    return _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel=False)[0]


def _moe_grouped_mm_sentinel(x, selected, weights, w1_w3, w2, *, k):
    return _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel=True)


def _moe_fused_replacement_2(x, selected, weights, w1_w3, w2, *, k):
    # the second output (the dead in-place clamp) has no users: any value will do
    return wb.torch_moe_fused.default(x, selected, weights, w1_w3, w2), selected


def _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp: bool):
    # transformers' batched_mm experts forward: gather every (token, slot)'s expert weights.
    # ``clamp``: as transformers 5.17 writes it, the expert ids clamped to 0..E-1 first
    # (expert-parallel sentinels; a no-op with E local experts).
    xs = x.repeat_interleave(k, dim=0)
    flat_w, flat_e = weights.reshape(-1), selected.reshape(-1)
    if clamp:
        flat_e = flat_e.clamp(0, _E - 1)
    h = torch.bmm(w1_w3[flat_e], xs.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(w2[flat_e], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = y * flat_w.unsqueeze(-1)
    return y.view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def _moe_batched_mm(x, selected, weights, w1_w3, w2, *, k):
    return _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp=False)


def _moe_batched_mm_clamped(x, selected, weights, w1_w3, w2, *, k):
    return _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp=True)


def _moe_fused_replacement(x, selected, weights, w1_w3, w2, *, k):
    return wb.torch_moe_fused.default(x, selected, weights, w1_w3, w2)


def _moe_check(m: Match) -> Optional[Dict[str, Any]]:
    """Shapes agree with a gated MoE: x [T, H], selected/weights [T, k], w1_w3 [E, 2I, H],
    w2 [E, H, I]; histc counts exactly the E experts; the final view is [T, k, H]."""
    x, sel, w = m.val("x"), m.val("selected"), m.val("weights")
    w13, w2 = m.val("w1_w3"), m.val("w2")
    if any(t is None for t in (x, sel, w, w13, w2)) or x.dim() != 2 or sel.dim() != 2:
        return None
    n_exp, two_i, hidden = w13.shape
    if sel.shape[-1] != m.literals["k"] or tuple(w2.shape) != (n_exp, hidden, two_i // 2):
        return None
    if sel.dtype.is_floating_point or not same_shape(w.shape, sel.shape):
        return None
    for h in m.matched(aten.histc.default):
        if tuple(h.args[1:4]) != (n_exp, 0, n_exp - 1):
            return None
    for ge in m.matched(aten.ge.Scalar):  # the sentinel test: ids >= E
        if ge.args[1] != n_exp:
            return None
    for c in m.matched(aten.clamp.default):  # the sentinel clamp: ids into 0..E-1
        if tuple(c.args[1:3]) != (0, n_exp - 1):
            return None
    for v in m.matched(aten.view.default):
        out = tensor_meta(v)
        if out is None or out.dim() != 3 or out.shape[1] != m.literals["k"]:
            return None
    return {}


# the experts' size arguments, and the batched form's clamp bound (a size in the unbiased spelling)
_IGNORE_SHAPES = (*EXPERT_SIZE_ARGS, (aten.clamp.default, "max"))


def moe_patterns() -> List[Pattern]:
    """The stacked-experts MoE patterns usable with the installed transformers."""
    forms = []
    if grouped_mm_op() is not None:
        forms += [
            ("moe_grouped_mm", _moe_grouped_mm, _moe_fused_replacement),
            ("moe_grouped_mm_sentinel", _moe_grouped_mm_sentinel, _moe_fused_replacement_2),
        ]
    forms += [
        ("moe_batched_mm", _moe_batched_mm, _moe_fused_replacement),
        ("moe_batched_mm_clamped", _moe_batched_mm_clamped, _moe_fused_replacement),
    ]
    return [
        Pattern(
            name,
            search,
            replace,
            _moe_examples,
            literals={"k": _K},
            ignore=_IGNORE_SHAPES,
            check=_moe_check,
            inputs=("x", "selected", "weights", "w1_w3", "w2"),
        )
        for name, search, replace in forms
    ]


@functools.lru_cache(maxsize=None)
def _stacked_expert_patterns(with_grouped_mm: bool) -> Tuple[Pattern, ...]:
    # One tuple per availability of transformers' grouped_mm op (tracing happens lazily, on first
    # use, and is kept with the tuple). gpt-oss's biased, transposed, clamped-SwiGLU experts
    # (biased_experts.py) reach the same op with its bias / activation options.
    assert with_grouped_mm == (grouped_mm_op() is not None)
    return tuple(moe_patterns()) + tuple(biased_expert_patterns())


@register("match_moe_pattern")
class MatchMoePattern(PatternTransform):
    """Replace transformers' stacked-experts MoE (grouped_mm / batched_mm; plain or gpt-oss's biased,
    clamped-SwiGLU experts) by ``torch_moe_fused``, and an unrolled loop over experts by ``torch_moe``."""

    def active_patterns(self) -> Sequence[Pattern]:
        # the grouped_mm forms only once transformers' MoE integration is loaded (grouped_mm_op)
        return _stacked_expert_patterns(grouped_mm_op() is not None)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        counts = PatternMatcher(self.active_patterns()).apply(gm)
        if any(n.target is aten.index_add_.default for n in gm.graph.nodes):  # an unrolled expert loop?
            counts["moe_expert_loop"] = replace_expert_loops(gm)
        return match_info(gm, counts)


__all__ = ["moe_patterns"]
