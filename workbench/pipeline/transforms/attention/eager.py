"""Eager attention (stage ``pattern_matcher``, ``match_eager_attention``): HF's matmul / softmax /
matmul -> ``torch_attention_sdpa``, and the eager variants SDPA cannot express straight to
``torch_attention``.

* plain ``eager_attention_forward`` (scale by ``*`` or ``/``, with or without mask and dropout, the
  softmax in fp32 or of logits upcast first) -> ``torch_attention_sdpa`` (step 2 of the chain in
  ``matchers.py``; step 3 makes it ``torch_attention``);
* logit soft-capping (Gemma 2) -> ``torch_attention(..., logit_cap=...)``;
* attention sinks as a softmax column (gpt-oss; also its sink-less layers' row-max spelling) or as
  ``sigmoid(logsumexp - sink)`` after the attention (Granite-SWA) -> ``torch_attention(..., sinks=...)``.

The variants' K/V are still repeated (``match_grouped_attention`` un-repeats them) and their masks
are classified as in step 3 (``variants.py``). ``match_eager_attention`` also runs ALiBi's eager
spellings (``alibi.py``), the older ones that replace logits through a causal table (``legacy.py``)
and the heads-folded-into-batch BMM spelling (``bmm_heads.py``).
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...graph.utils import tensor_meta
from ...interface import register
from ...matcher import EVAL_DROPOUT, Match, Pattern, PatternTransform, named_args, same_shape, same_size
from .alibi import ALIBI_EAGER_PATTERNS
from .bmm_heads import BMM_HEADS_PATTERNS
from .legacy import LEGACY_EAGER_PATTERNS
from .variants import SCALE, variant_masking, variant_replacement

aten = torch.ops.aten
wb = torch.ops.workbench

# Sentinels (see pipeline/matcher): values that appear nowhere else in the traced patterns (the scale's: ``SCALE``).
_CAP = 41.5


def _masked_softmax_times_v(w, q, v, mask, with_dropout: bool, upcast: bool = False):
    """The end of HF's eager attention after the logits ``w``: the mask added, softmax in fp32 cast
    back to q's dtype, dropout (inference: p=0 / training=False), times v. ``upcast``: the logits
    cast to fp32 first and the softmax left without a dtype (``w.float().softmax(-1).to(q.dtype)``,
    the spelling of older HF models and much custom code) -- the same numbers."""
    if mask:
        w = w + mask[0]
    if upcast:
        w = F.softmax(w.to(torch.float32), dim=-1).to(q.dtype)
    else:
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    if with_dropout:
        w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


def _eager_attention(scale_op: str, with_mask: bool, with_dropout: bool, upcast: bool = False) -> Pattern:
    """HF ``eager_attention_forward`` (after repeat_kv): softmax in fp32 (``upcast``: of logits
    cast to fp32), cast back, dropout (inference: p=0 / training=False; other models skip it)."""

    def search(q, k, v, *mask, scale):
        w = torch.matmul(q, k.transpose(2, 3))
        w = w * scale if scale_op == "mul" else w / scale
        return _masked_softmax_times_v(w, q, v, mask, with_dropout, upcast)

    def replacement(q, k, v, *mask, scale):
        s = scale if scale_op == "mul" else 1.0 / scale
        return wb.torch_attention_sdpa.default(q, k, v, attn_mask=mask[0] if mask else None, scale=s)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        # The cast after the softmax (dtype ignored in the trace) must return to q's dtype; an
        # upcast before it must go to fp32 (a softmax in bf16 is another computation).
        (softmax,) = m.matched(aten.softmax.int)
        back = next(c for c in m.matched(aten.to.dtype) if c.args[0] is softmax)
        q = m.val("q")
        if q is None or q.dim() != 4 or back.args[1] != q.dtype:
            return None
        if upcast and softmax.args[0].args[1] != torch.float32:
            return None
        return {}

    return _eager_pattern(
        f"eager_attention_{scale_op}{_suffix(with_mask, with_dropout)}{'_upcast' if upcast else ''}",
        search,
        replacement,
        check,
        with_mask,
        literals={"scale": SCALE},
        ignore=((aten.to.dtype, "dtype"),),
    )


def _suffix(with_mask: bool, with_dropout: bool) -> str:
    return f"{'_mask' if with_mask else ''}{'_dropout' if with_dropout else ''}"


def _eager_pattern(
    name: str, search, replacement, check, with_mask: bool, *, literals, ignore, with_sinks: bool = False
) -> Pattern:
    """The ``Pattern`` of one eager-attention form: inputs q, k, v (examples [1, 2, 4, 8]), then
    ``sinks`` ([2]) when ``with_sinks``, then ``attn_mask`` ([1, 1, 4, 4]) when ``with_mask``."""
    sinks, mask = ("sinks",) if with_sinks else (), ("attn_mask",) if with_mask else ()

    def examples():
        t = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
        return (*t, *(torch.randn(2) for _ in sinks), *(torch.zeros(1, 1, 4, 4) for _ in mask))

    return Pattern(
        name,
        search,
        replacement,
        examples,
        literals=literals,
        ignore=(*ignore, *EVAL_DROPOUT),
        check=check,
        inputs=("q", "k", "v", *sinks, *mask),
    )


def _softcapped_eager_attention(with_mask: bool, with_dropout: bool) -> Pattern:
    """Gemma 2's ``eager_attention_forward`` (after repeat_kv): scaled logits soft-capped as
    ``cap * tanh(x / cap)`` *before* the mask, fp32 softmax, cast back, dropout. SDPA has no
    soft-cap, so this goes straight to ``torch_attention(..., logit_cap=cap)``."""

    def search(q, k, v, *mask, scale, cap):
        w = torch.matmul(q, k.transpose(2, 3)) * scale
        w = torch.tanh(w / cap) * cap
        return _masked_softmax_times_v(w, q, v, mask, with_dropout)

    def replacement(q, k, v, *mask, cap, **flags):
        return variant_replacement(q, k, v, mask, logit_cap=float(cap), **flags)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        (cast,) = m.matched(aten.to.dtype)
        q, cap = m.val("q"), m.literals["cap"]
        if q is None or cast.args[1] != q.dtype or not isinstance(cap, (int, float)) or cap <= 0:
            return None
        return variant_masking(m, with_mask)

    return _eager_pattern(
        f"softcapped_eager_attention{_suffix(with_mask, with_dropout)}",
        search,
        replacement,
        check,
        with_mask,
        literals={"scale": SCALE, "cap": _CAP},
        ignore=((aten.to.dtype, "dtype"),),
    )


def _max_subtracted_eager_attention(with_sinks: bool, with_mask: bool, with_dropout: bool, with_cast: bool) -> Pattern:
    """gpt-oss's ``eager_attention_forward`` (after repeat_kv): one learned logit per head
    (``sinks`` [n]) joins each softmax row and is dropped after it -- it takes probability mass
    but has no value. The row max is subtracted first (a no-op for the softmax, kept by HF
    against overflow). -> ``torch_attention(..., sinks=sinks)``. ``with_cast``: the probabilities
    are cast to v's dtype before the last matmul (transformers 5.23 does; older releases do not).
    Without ``with_sinks``: the same spelling on layers that have no sinks (MiMo-V2-Flash's
    full-attention layers beside its sink-carrying sliding ones) -> ``torch_attention``."""

    def search(q, k, v, *rest, scale):
        sinks, mask = (rest[0], rest[1:]) if with_sinks else (None, rest)
        w = torch.matmul(q, k.transpose(2, 3)) * scale
        if mask:
            w = w + mask[0]
        if with_sinks:
            sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
            w = torch.cat([w, sink], dim=-1)
        logits = w - w.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
        if with_sinks:
            probs = probs[..., :-1]
        if with_dropout:
            probs = F.dropout(probs, p=0.0, training=False)
        return torch.matmul(probs.to(v.dtype) if with_cast else probs, v)

    def replacement(q, k, v, *rest, **flags):
        if with_sinks:
            return variant_replacement(q, k, v, rest[1:], sinks=rest[0], **flags)
        return variant_replacement(q, k, v, rest, **flags)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        # The ignored sizes: sinks is one logit per query head, broadcast to [b, n, s_q, 1]; the
        # softmax runs in the logits' dtype and the cast goes to v's dtype.
        (softmax,) = m.matched(aten.softmax.int)
        q, v = m.val("q"), m.val("v")
        if q is None or v is None or q.dim() != 4:
            return None
        if with_sinks:
            (expand,) = m.matched(aten.expand.default)
            sinks, e = m.val("sinks"), tensor_meta(expand)
            if sinks is None or e is None or sinks.dim() != 1:
                return None
            b, n, s_q, _ = q.shape
            if not same_size(sinks.shape[0], n) or not same_shape(e.shape, (b, n, s_q, 1)):
                return None
        probs_dtype = dict(named_args(softmax))["dtype"]
        logits = tensor_meta(softmax.args[0])
        if logits is None or probs_dtype != logits.dtype:
            return None
        if (m.matched(aten.to.dtype)[0].args[1] if with_cast else probs_dtype) != v.dtype:
            return None
        return variant_masking(m, with_mask)

    return _eager_pattern(
        f"{'sink' if with_sinks else 'max_subtracted'}_eager_attention{_suffix(with_mask, with_dropout)}"
        f"{'_cast' if with_cast else ''}",
        search,
        replacement,
        check,
        with_mask,
        literals={"scale": SCALE},
        ignore=((aten.expand.default, "size"), (aten.softmax.int, "dtype"), (aten.to.dtype, "dtype")),
        with_sinks=with_sinks,
    )


def _lse_sink_eager_attention(with_mask: bool, with_dropout: bool) -> Pattern:
    """Granite-SWA's ``eager_attention_forward`` (after repeat_kv): the sink applied after the
    attention as ``out * sigmoid(logsumexp(w) - sink)`` -- the share of the softmax mass the visible
    keys keep once the sink logit joins the denominator, so the same attention as gpt-oss's sink
    column (fp32 rounding apart). -> ``torch_attention(..., sinks=sinks)``."""

    def search(q, k, v, sinks, *mask, scale):
        w = torch.matmul(q, k.transpose(2, 3)) * scale
        if mask:
            w = w + mask[0]
        sink_scale = (torch.logsumexp(w, dim=-1) - sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
        probs = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        if with_dropout:
            probs = F.dropout(probs, p=0.0, training=False)
        out = torch.matmul(probs, v)
        return out * sink_scale.unsqueeze(-1).to(out.dtype)

    def replacement(q, k, v, sinks, *mask, **flags):
        return variant_replacement(q, k, v, mask, sinks=sinks, **flags)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        # casts: the scale to fp32, the probabilities back to q's dtype, the scale to the output's
        q, sinks = m.val("q"), m.val("sinks")
        if q is None or sinks is None or q.dim() != 4 or sinks.dim() != 1 or not same_size(sinks.shape[0], q.shape[1]):
            return None
        (softmax,) = m.matched(aten.softmax.int)
        if dict(named_args(softmax))["dtype"] != torch.float32:
            return None
        casts = sorted(str(c.args[1]) for c in m.matched(aten.to.dtype))
        if casts != sorted(map(str, (torch.float32, q.dtype, q.dtype))):
            return None
        return variant_masking(m, with_mask)

    return _eager_pattern(
        f"lse_sink_eager_attention{_suffix(with_mask, with_dropout)}",
        search,
        replacement,
        check,
        with_mask,
        literals={"scale": SCALE},
        ignore=((aten.softmax.int, "dtype"), (aten.to.dtype, "dtype")),
        with_sinks=True,
    )


# The variants first, most specific first. (The plain patterns cannot take their nodes anyway: a
# plain softmax reads the mask add or the scaled matmul, never a tanh or a row-max subtraction.)
EAGER_VARIANT_PATTERNS = (
    *(_softcapped_eager_attention(mask, dropout) for mask, dropout in itertools.product((True, False), repeat=2)),
    *(_max_subtracted_eager_attention(*flags) for flags in itertools.product((True, False), repeat=4)),
    *(_lse_sink_eager_attention(mask, dropout) for mask, dropout in itertools.product((True, False), repeat=2)),
)
EAGER_ATTENTION_PATTERNS = tuple(
    _eager_attention(op, mask, dropout, upcast)
    for mask, op, dropout, upcast in itertools.product((True, False), ("mul", "div"), (True, False), (False, True))
)


@register("match_eager_attention")
class MatchEagerAttention(PatternTransform):
    """Replace eager attention (matmul, scale, mask, softmax, matmul) by ``torch_attention_sdpa``,
    and its soft-capped / sink variants by ``torch_attention`` with ``logit_cap`` / ``sinks``."""

    patterns = (
        EAGER_VARIANT_PATTERNS
        + ALIBI_EAGER_PATTERNS
        + EAGER_ATTENTION_PATTERNS
        + LEGACY_EAGER_PATTERNS
        + BMM_HEADS_PATTERNS
    )


__all__ = ["EAGER_ATTENTION_PATTERNS", "EAGER_VARIANT_PATTERNS"]
