"""Older eager attention spellings (stage ``pattern_matcher``, part of ``match_eager_attention``).

Families written before HF's shared ``eager_attention_forward`` hide the future keys by *replacing*
their logits, with a lower-triangular table the module registers as a buffer
([1, 1, max_pos, max_pos], sliced ``[:, :, k - q : k, :k]``):

* ``where`` (GPT-Neo): ``w = torch.where(table, w, fill)`` with ``fill`` a tensor (finfo.min), then
  HF's additive mask added; logits unscaled; q and k cast to fp32 first; probabilities cast to
  v's dtype.
* ``arith`` (OpenAI GPT): ``w = w * b + fill * (1 - b)`` with ``b`` a float 0/1 table and
  ``fill = -1e4``; the key handed over already transposed (``permute(0, 2, 3, 1)``), logits divided
  by sqrt(d) or not at all.

Both become ``torch_attention`` with an explicit additive mask that says the same thing:
``where(visible, m, -inf)`` (``m``: HF's additive mask, or 0). Replacing a logit by ``fill`` and
hiding it differ only in the weight ``exp(fill - row max)``, which is exactly 0 in fp32 once
``fill - max < -104``: for ``fill <= -1e4`` on every row whose best visible logit is above -9,896
(causal rows always keep their own key). Smaller fills are not matched. The arith form's table
must hold only 0 and 1 (``b * w`` with another ``b`` scales logits): a table entry that is neither
makes the mask NaN, so the explicit-mask run fails the numerics check loudly instead of drifting.

The table is a buffer whose value is only known after ``load_weights`` (the graph is traced on
meta), so the mask stays explicit here; ``insert_cached_attention`` classifies it again with the
loaded buffers (``masks.classify_mask``) and drops it for ``is_causal`` / ``sliding_window`` when
it is a causal (GPT-Neo local layers: banded) table.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from ...graph.utils import tensor_meta
from ...matcher import EVAL_DROPOUT, Match, Pattern, same_size
from ...matcher.masks import constant_tensor
from .variants import SCALE

aten = torch.ops.aten
wb = torch.ops.workbench

_FILL = -12345.5  # a sentinel (see pipeline/matcher), like ``SCALE``: a value appearing nowhere else
# A replaced logit at or below this is a hidden key (see the module docstring).
REPLACED_HIDDEN = -1e4


def _logits(q, kt, scale_op: str, scale):
    w = torch.matmul(q, kt)
    if scale_op == "mul":
        return w * scale
    if scale_op == "div":
        return w / scale
    return w


def _legacy_attention(form: str, scale_op: str, with_mask: bool, with_cast: bool, with_dropout: bool) -> Pattern:
    """One spelling: ``form`` where | arith, ``scale_op`` none | mul | div, then HF's additive mask
    or not, the probabilities cast (to v's dtype) or not, eval dropout or not."""

    def search(q, kt, v, table, *rest, **lits):
        w = _logits(q, kt, scale_op, lits.get("scale"))
        if form == "where":
            w = torch.where(table, w, rest[0])
            mask = rest[1:]
        else:
            w = w * table + (1 - table) * lits["fill"]
            mask = rest
        if mask:
            w = w + mask[0]
        p = F.softmax(w, dim=-1)
        if with_cast:
            p = p.to(torch.float32)
        if with_dropout:
            p = F.dropout(p, p=0.0, training=False)
        return torch.matmul(p, v)

    def replacement(q, kt, v, table, *rest, scale=None, fill=None):
        mask = rest[1:] if form == "where" else rest
        added = mask[0] if mask else 0.0
        if form == "where":
            m = torch.where(table, added, float("-inf"))
        else:
            # 0 where the table is 1, -inf where it is 0, NaN anywhere else (see the docstring)
            hidden = torch.where(table == 0, float("-inf"), float("nan"))
            m = torch.where(table == 1, 0.0, hidden)
            if mask:
                m = m + added
        s = 1.0 if scale_op == "none" else (float(scale) if scale_op == "mul" else 1.0 / float(scale))
        k = aten.transpose.int(kt, 2, 3)
        return wb.torch_attention.default(q, k, v, attn_mask=m, is_causal=False, scale=s, layout="bnsd")

    def check(m: Match) -> Optional[Dict[str, Any]]:
        q, kt, v, table = m.val("q"), m.val("kt"), m.val("v"), m.val("table")
        if any(t is None or t.dim() != 4 for t in (q, kt, v)) or table is None:
            return None
        # kt is the key transposed: [b, n_kv, d, s_k]; whole KV groups; v [b, n_kv, s_k, d_v]
        if not same_size(q.shape[3], kt.shape[2]) or q.shape[1] % kt.shape[1] or q.shape[1] % v.shape[1]:
            return None
        if not same_size(kt.shape[3], v.shape[2]):
            return None
        # one dtype throughout (GPT-Neo casts q and k to fp32: a bf16 model's v would differ, and
        # is left unmatched, reported uncached); the cast, where present, is then a no-op
        (softmax,) = m.matched(aten.softmax.int)
        probs = tensor_meta(softmax)
        if probs is None or not (q.dtype == kt.dtype == v.dtype == probs.dtype):
            return None
        if with_cast and m.matched(aten.to.dtype)[0].args[1] != v.dtype:
            return None
        if form == "where":
            value = _constant_value(m.inputs["fill"])
            if table.dtype != torch.bool or value is None or value > REPLACED_HIDDEN:
                return None
        else:
            fill = m.literals["fill"]
            if not table.is_floating_point() or not isinstance(fill, (int, float)) or fill > REPLACED_HIDDEN:
                return None
        out: Dict[str, Any] = {}
        if scale_op != "none":
            scale = m.literals["scale"]
            if not isinstance(scale, (int, float)) or scale <= 0:
                return None
            out["scale"] = scale
        return out

    def examples():
        q, kt, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 4, 8)
        if form == "where":
            table = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
            rest = (torch.tensor(-3e38),)
        else:
            table, rest = torch.ones(1, 1, 4, 4).tril(), ()
        return (q, kt, v, table, *rest, *((torch.zeros(1, 1, 4, 4),) if with_mask else ()))

    literals: Dict[str, Any] = {} if scale_op == "none" else {"scale": SCALE}
    if form == "arith":
        literals["fill"] = _FILL
    names = ("q", "kt", "v", "table", *(("fill",) if form == "where" else ()), *(("attn_mask",) if with_mask else ()))
    suffix = (
        f"{scale_op}{'_mask' if with_mask else ''}{'_cast' if with_cast else ''}{'_dropout' if with_dropout else ''}"
    )
    return Pattern(
        f"legacy_{form}_attention_{suffix}",
        search,
        replacement,
        examples,
        literals=literals,
        ignore=((aten.to.dtype, "dtype"), *EVAL_DROPOUT),
        check=check,
        inputs=names,
    )


def _constant_value(node: Any) -> Optional[float]:
    """The value of a 0-dim constant the trace lifted (``torch.tensor(finfo.min)``), through the
    ``lift_fresh_copy`` / ``detach_`` export wraps it in."""
    while hasattr(node, "target") and node.target in (aten.lift_fresh_copy.default, aten.detach_.default):
        node = node.args[0]
    if getattr(node, "op", None) != "get_attr":
        return None
    value = constant_tensor(node)
    return None if value is None or value.dim() != 0 else float(value)


LEGACY_EAGER_PATTERNS = tuple(
    _legacy_attention(form, scale_op, mask, cast, dropout)
    for form, scale_op, mask, cast, dropout in itertools.product(
        ("where", "arith"), ("none", "div", "mul"), (True, False), (True, False), (True, False)
    )
)

__all__ = ["LEGACY_EAGER_PATTERNS", "REPLACED_HIDDEN"]
