"""gpt-oss's experts as transformers>=5 exports them -> ``torch_moe_fused`` with biases (``match_moe_pattern``).

``GptOssExperts`` is declared to transformers' experts integration as ``is_transposed=True,
has_bias=True, is_concatenated=False``, with its own ``_apply_gate``:

* weights stored ``[in, out]``: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` (the grouped GEMM
  takes them as they are; the batched form multiplies ``x[1, H] @ W[H, 2I]``);
* biases ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``, gathered per sorted (token, slot)
  and added in place after each GEMM;
* gate/up rows interleaved: ``gate = h[:, ::2]``, ``up = h[:, 1::2]``;
* the clamped SwiGLU: ``min(gate, limit)``, ``clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(gate * alpha)`` (alpha 1.702, limit ``config.swiglu_limit``).

The replacement reads the weights through ``transpose(1, 2)`` views (``[E, 2I, H]`` / ``[E, H, I]``,
``nn.Linear`` layout, no copy) and passes the biases, the interleaved layout and alpha / limit as
``torch_moe_fused`` options (``ops/moe/expert_mlp.py``). Export spells the experts by
``config._experts_implementation``: ``grouped_mm`` (the default: sort by expert, two
``transformers::grouped_mm_fallback``), ``batched_mm`` (gather each slot's expert weights, ``bmm``);
``eager`` loops over the experts that got tokens and does not export. ``grouped_mm`` with an
expert-parallel sentinel mask (transformers 5.17 writes it always; 5.23 only when experts are
sharded) has its own pattern, as for the unbiased experts in ``matchers.py`` (the sort and the
un-permute both share: ``grouped_mm.py``).

The router stays outside (gpt-oss's is top-k over the logits, then softmax over the k values).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...graph.utils import tensor_meta
from ...matcher import Match, Pattern, same_shape
from .grouped_mm import EXPERT_SIZE_ARGS, grouped_mm_op, sort_by_expert, unsort_by_expert

aten = torch.ops.aten
wb = torch.ops.workbench

# Example sizes and literal sentinels for tracing: T tokens, H hidden, I intermediate, E experts, k.
_T, _H, _I, _E, _K = 5, 8, 6, 7, 3
_ALPHA, _LIMIT = 1.625, 7.25  # sentinels: any alpha / limit in the model graph binds to them


def _examples():
    selected = torch.stack([torch.randperm(_E)[:_K] for _ in range(_T)])
    return (
        torch.randn(_T, _H),
        selected,
        torch.rand(_T, _K),
        torch.randn(_E, _H, 2 * _I),
        torch.randn(_E, 2 * _I),
        torch.randn(_E, _I, _H),
        torch.randn(_E, _H),
    )


def _clamped_swiglu(h, alpha, limit, neg_limit):
    # GptOssExperts._apply_gate, written as it is (interleaved halves, then the clamped SwiGLU)
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=neg_limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def _grouped(x, selected, weights, w1_w3, b1_w3, w2, b2, k, alpha, limit, neg_limit, sentinel: bool):
    # transformers' grouped_mm experts forward with transposed weights and biases
    mm = grouped_mm_op()
    rows = sort_by_expert(x, selected, weights, k, _E, sentinel)
    h = mm(rows.xs.to(w1_w3.dtype), w1_w3, rows.offsets)
    h.add_(b1_w3[rows.expert_sorted])
    h = h.masked_fill(rows.mask, 0.0) if rows.mask is not None else h
    g = _clamped_swiglu(h, alpha, limit, neg_limit)
    y = mm(g.to(w2.dtype), w2, rows.offsets)
    y.add_(b2[rows.expert_sorted])
    y = y.masked_fill(rows.mask, 0.0) if rows.mask is not None else y
    return unsort_by_expert(y, rows, x, k)


def _gpt_oss_grouped_mm(x, selected, weights, w1_w3, b1_w3, w2, b2, *, k, alpha, limit, neg_limit):
    return _grouped(x, selected, weights, w1_w3, b1_w3, w2, b2, k, alpha, limit, neg_limit, sentinel=False)


def _gpt_oss_grouped_mm_sentinel(x, selected, weights, w1_w3, b1_w3, w2, b2, *, k, alpha, limit, neg_limit):
    return _grouped(x, selected, weights, w1_w3, b1_w3, w2, b2, k, alpha, limit, neg_limit, sentinel=True)


def _gpt_oss_batched_mm(x, selected, weights, w1_w3, b1_w3, w2, b2, *, k, alpha, limit, neg_limit):
    # transformers' batched_mm experts forward with transposed weights and biases
    xs = x.repeat_interleave(k, dim=0)
    flat_w, flat_e = weights.reshape(-1), selected.reshape(-1)
    w_sel, b_sel = w1_w3[flat_e], b1_w3[flat_e]
    h = torch.bmm(xs.unsqueeze(1), w_sel).squeeze(1)
    h.add_(b_sel)
    g = _clamped_swiglu(h, alpha, limit, neg_limit)
    w_sel, b_sel = w2[flat_e], b2[flat_e]
    y = torch.bmm(g.unsqueeze(1), w_sel).squeeze(1)
    y.add_(b_sel)
    y = y * flat_w.unsqueeze(-1)
    return y.view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def _replacement(x, selected, weights, w1_w3, b1_w3, w2, b2, *, k, alpha, limit, neg_limit):
    # [E, H, 2I] / [E, I, H] stored [in, out] -> nn.Linear layout views [E, 2I, H] / [E, H, I]
    return wb.torch_moe_fused.default(
        x,
        selected,
        weights,
        aten.transpose.int(w1_w3, 1, 2),
        aten.transpose.int(w2, 1, 2),
        "clamped_swiglu",
        b1_w3,
        b2,
        True,
        alpha,
        limit,
    )


def _check(m: Match) -> Optional[Dict[str, Any]]:
    """x [T, H], selected/weights [T, k], w1_w3 [E, H, 2I], b1_w3 [E, 2I], w2 [E, I, H], b2 [E, H];
    the up clamp is symmetric (-limit, limit); histc counts the E experts; the final view is [T, k, H]."""
    names = ("x", "selected", "weights", "w1_w3", "b1_w3", "w2", "b2")
    x, sel, w, w13, b13, w2, b2 = (m.val(n) for n in names)
    if any(t is None for t in (x, sel, w, w13, b13, w2, b2)) or x.dim() != 2 or sel.dim() != 2 or w13.dim() != 3:
        return None
    k = m.literals["k"]
    n_exp, hidden, two_i = w13.shape
    if two_i % 2 or hidden != x.shape[-1] or tuple(w2.shape) != (n_exp, two_i // 2, hidden):
        return None
    if tuple(b13.shape) != (n_exp, two_i) or tuple(b2.shape) != (n_exp, hidden):
        return None
    if sel.shape[-1] != k or sel.dtype.is_floating_point or not same_shape(w.shape, sel.shape):
        return None
    if m.literals["neg_limit"] != -m.literals["limit"]:
        return None
    for h in m.matched(aten.histc.default):
        if tuple(h.args[1:4]) != (n_exp, 0, n_exp - 1):
            return None
    for ge in m.matched(aten.ge.Scalar):
        if ge.args[1] != n_exp:
            return None
    for v in m.matched(aten.view.default):
        out = tensor_meta(v)
        if out is None or out.dim() != 3 or out.shape[1] != k:
            return None
    return {}


def biased_expert_patterns() -> List[Pattern]:
    """gpt-oss's experts patterns usable with the installed transformers."""
    forms = []
    if grouped_mm_op() is not None:
        forms += [
            ("gpt_oss_grouped_mm", _gpt_oss_grouped_mm),
            ("gpt_oss_grouped_mm_sentinel", _gpt_oss_grouped_mm_sentinel),
        ]
    forms.append(("gpt_oss_batched_mm", _gpt_oss_batched_mm))
    return [
        Pattern(
            name,
            search,
            _replacement,
            _examples,
            literals={"k": _K, "alpha": _ALPHA, "limit": _LIMIT, "neg_limit": -_LIMIT},
            ignore=EXPERT_SIZE_ARGS,
            check=_check,
            inputs=("x", "selected", "weights", "w1_w3", "b1_w3", "w2", "b2"),
        )
        for name, search in forms
    ]


__all__ = ["biased_expert_patterns"]
