"""Attention patterns (stage ``pattern_matcher``): every attention spelling -> ``torch_attention``.

The chain, in pipeline order:

1. ``match_repeat_kv``: HF ``repeat_kv`` (unsqueeze/expand/reshape) -> ``torch_attention_repeat_kv``.
2. ``match_eager_attention``: matmul/softmax/matmul -> ``torch_attention_sdpa``; the eager
   variants SDPA cannot express -- logit soft-capping (Gemma 2) and attention sinks (gpt-oss) --
   straight to ``torch_attention(..., logit_cap=..., sinks=...)`` (K/V still repeated: step 4
   un-repeats them), their masks classified as in step 3. ALiBi's eager spellings (BLOOM, MPT,
   Falcon; ``alibi.py``) also go straight to ``torch_attention(..., alibi_slopes=...)``, and the
   older spellings that replace logits through a registered causal table (GPT-Neo, OpenAI GPT;
   ``legacy.py``) to ``torch_attention`` with an explicit mask, classified after load.
3. ``match_sdpa_to_torch_attention``: ``aten.scaled_dot_product_attention`` and
   ``torch_attention_sdpa`` (with or without repeated K/V) -> ``torch_attention`` with native GQA.
   A mask that only encodes causality (HF passes an explicit boolean mask built from aranges) is
   dropped in favour of ``is_causal`` (+ ``sliding_window`` or ``chunk_size``), which backends can implement without
   materialising a [s, s] mask (``masks.py``: HF's boolean SDPA masks and its additive eager
   masks alike).
   An SDPA mask that is a causal mask with an ALiBi bias folded in (Falcon) becomes ``is_causal``
   + ``alibi_slopes`` (``alibi.py``).
4. ``match_grouped_attention``: ``torch_attention`` still fed by repeated K/V -> un-repeated K/V.

Layout changes (``match_attention_layout``) live in ``layout.py``.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import (
    EVAL_DROPOUT,
    Match,
    Pattern,
    PatternMatcher,
    PatternTransform,
    match_info,
    named_args,
    same_shape,
    same_size,
)
from ...matcher.masks import MaskKind, attention_mask_arguments, classify_mask
from .alibi import ALIBI_EAGER_PATTERNS, ALIBI_SDPA_PATTERNS
from .bmm_heads import BMM_HEADS_PATTERNS
from .legacy import LEGACY_EAGER_PATTERNS
from .variants import chunk_kwargs, variant_masking, variant_replacement

aten = torch.ops.aten
wb = torch.ops.workbench

# Sentinels (see pipeline/matcher): values that appear nowhere else in the traced patterns.
_N_REP = 3
_SCALE = 0.3125
_CAP = 41.5


# ------------------------------------------------------------------------------ repeat_kv


def _repeat_kv(x):
    # HF repeat_kv: [b, n_kv, s, d] -> [b, n_kv * n_rep, s, d]. Traced with n_rep=3 (example 2 -> 6
    # heads); the sizes are ignored and re-derived from shapes in the check.
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, _N_REP, s, d).reshape(b, n_kv * _N_REP, s, d)


def _repeat_kv_replacement(x, *, n_rep):
    return wb.torch_attention_repeat_kv.default(x, n_rep)


def _repeat_check(heads_dim: int):
    """The check of a repeat whose heads are dim ``heads_dim`` of x (1: bnsd, 2: bsnd): the expand
    really repeats each KV head ``n_rep`` times (a new dim right after the heads) and the reshape
    merges exactly that."""

    def check(m: Match) -> Optional[Dict[str, Any]]:
        x = m.val("x")
        (expand,), (reshape,) = m.matched(aten.expand.default), m.matched(aten.reshape.default)
        e, r = tensor_meta(expand), tensor_meta(reshape)
        if x is None or e is None or r is None or x.dim() != 4 or e.dim() != 5:
            return None
        n_rep = e.shape[heads_dim + 1]
        if not isinstance(n_rep, int):
            return None
        shape = list(x.shape)
        repeated = shape[: heads_dim + 1] + [n_rep] + shape[heads_dim + 1 :]
        merged = shape[:heads_dim] + [shape[heads_dim] * n_rep] + shape[heads_dim + 1 :]
        if not same_shape(e.shape, repeated) or not same_shape(r.shape, merged):
            return None
        return {"n_rep": n_rep}

    return check


REPEAT_KV_PATTERN = Pattern(
    "repeat_kv",
    _repeat_kv,
    _repeat_kv_replacement,
    lambda: (torch.randn(1, 2, 4, 8),),
    ignore=((aten.expand.default, "size"), (aten.reshape.default, "shape")),
    check=_repeat_check(1),
)


def _repeat_kv_bsnd(x):
    # The same repeat in the bsnd layout: [b, s, n_kv, d] -> [b, s, n_kv * n_rep, d] (custom code
    # that keeps heads third). The sizes are again re-derived in the check.
    b, s, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, n_kv, _N_REP, d).reshape(b, s, n_kv * _N_REP, d)


def _repeat_kv_bsnd_replacement(x, *, n_rep):
    # Our op repeats bnsd heads: around it, transposes that the bnsd attention's own transpose
    # cancels (match_grouped_attention looks through such pairs; eliminate_redundant_transposes
    # removes them).
    return aten.transpose.int(wb.torch_attention_repeat_kv.default(aten.transpose.int(x, 1, 2), n_rep), 1, 2)


REPEAT_KV_BSND_PATTERN = Pattern(
    "repeat_kv_bsnd",
    _repeat_kv_bsnd,
    _repeat_kv_bsnd_replacement,
    lambda: (torch.randn(1, 4, 2, 8),),
    ignore=((aten.expand.default, "size"), (aten.reshape.default, "shape")),
    check=_repeat_check(2),
)


def _through_transpose_pairs(node: Any) -> Any:
    """``y`` for ``transpose(transpose(y, 1, 2), 1, 2)`` (repeatedly), else ``node``."""
    while (
        isinstance(node, fx.Node)
        and node.target is aten.transpose.int
        and sorted(node.args[1:3]) == [1, 2]
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is aten.transpose.int
        and sorted(node.args[0].args[1:3]) == [1, 2]
    ):
        node = node.args[0].args[0]
    return node


def repeat_kv_source(gm: fx.GraphModule, node: Any) -> Optional[Tuple[fx.Node, int]]:
    """``(x, n_rep)`` if ``node`` repeats KV heads of ``x`` (our op, or the raw HF chain), also
    behind a pair of transposes that cancel (a repeat in the bsnd layout, transposed to bnsd)."""
    node = _through_transpose_pairs(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is wb.torch_attention_repeat_kv.default:
        return node.args[0], node.args[1]
    if node.target is aten.reshape.default:
        m = PatternMatcher().match_at(gm, REPEAT_KV_PATTERN, node)
        if m is not None:
            return m.inputs["x"], m.literals["n_rep"]
    return None


@register("match_repeat_kv")
class MatchRepeatKV(PatternTransform):
    """Replace HF's repeat_kv chain (and its bsnd spelling) by ``torch_attention_repeat_kv(x, n_rep)``."""

    patterns = (REPEAT_KV_PATTERN, REPEAT_KV_BSND_PATTERN)


# ------------------------------------------------------------------------------ eager attention


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
        literals={"scale": _SCALE},
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
        literals={"scale": _SCALE, "cap": _CAP},
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
        literals={"scale": _SCALE},
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
        literals={"scale": _SCALE},
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


# ------------------------------------------------------------------------------ sdpa -> torch_attention


_SDPA_FLAGS = ("dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_pattern(source: str, repeated: bool, with_mask: bool) -> Pattern:
    """``source`` (aten SDPA or our torch_attention_sdpa) on (maybe repeated) K/V, (maybe) masked."""
    op = aten.scaled_dot_product_attention.default if source == "aten" else wb.torch_attention_sdpa.default

    def search(q, k, v, *mask, n_rep=None):
        if repeated:
            k = wb.torch_attention_repeat_kv.default(k, n_rep)
            v = wb.torch_attention_repeat_kv.default(v, n_rep)
        m = mask[0] if mask else None
        if source == "aten":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return wb.torch_attention_sdpa.default(q, k, v, m)

    def replacement(q, k, v, *mask, keep_mask, dropout_p, is_causal, scale, sliding_window, chunk_size=None, **_):
        return wb.torch_attention.default(
            q,
            k,
            v,
            attn_mask=mask[0] if mask and keep_mask else None,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            sliding_window=sliding_window,
            layout="bnsd",
            **chunk_kwargs(chunk_size),
        )

    def check(m: Match) -> Optional[Dict[str, Any]]:
        q, k, v = m.val("q"), m.val("k"), m.val("v")
        if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4:
            return None
        if q.shape[1] % k.shape[1] or not same_size(k.shape[1], v.shape[1]):
            return None
        flags = dict(named_args(m.outputs[0]))
        mask = m.inputs["attn_mask"] if with_mask else None
        return {
            "dropout_p": flags["dropout_p"],
            "scale": flags["scale"],
            **attention_mask_arguments(mask, q, k, is_causal=bool(flags["is_causal"])),
        }

    def examples():
        n_kv = 2 if repeated else 6
        t = (torch.randn(1, 6, 4, 8), torch.randn(1, n_kv, 4, 8), torch.randn(1, n_kv, 4, 8))
        return (*t, torch.ones(1, 1, 4, 4, dtype=torch.bool)) if with_mask else t

    return Pattern(
        f"{source}_sdpa{'_repeat_kv' if repeated else ''}{'_mask' if with_mask else ''}",
        search,
        replacement,
        examples,
        literals={"n_rep": _N_REP} if repeated else {},
        ignore=tuple((op, name) for name in _SDPA_FLAGS),
        check=check,
        inputs=("q", "k", "v", "attn_mask") if with_mask else ("q", "k", "v"),
    )


SDPA_PATTERNS = tuple(
    _sdpa_pattern(source, repeated, with_mask)
    for source, repeated, with_mask in itertools.product(("aten", "workbench"), (True, False), (True, False))
)


@register("match_sdpa_to_torch_attention")
class MatchSDPAToTorchAttention(PatternTransform):
    """Replace SDPA (aten or ``torch_attention_sdpa``), with or without repeat_kv, by
    ``torch_attention`` in bnsd layout; causal-only masks become ``is_causal``/``sliding_window``."""

    patterns = ALIBI_SDPA_PATTERNS + SDPA_PATTERNS  # ALiBi first: the general ones would keep its mask


# ------------------------------------------------------------------------------ grouped attention


@register("match_grouped_attention")
class MatchGroupedAttention(Transform):
    """Feed ``torch_attention`` the un-repeated K/V wherever it still gets repeated ones.

    Catches what ``match_sdpa_to_torch_attention`` could not see, e.g. repeat_kv matched after it
    or a raw expand/reshape chain. bnsd only: that is the layout repeat_kv repeats in.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        n = 0
        for node in call_nodes(gm, wb.torch_attention.default):
            args = dict(named_args(node))
            if args["layout"] != "bnsd":
                continue
            k_src, v_src = repeat_kv_source(gm, args["key"]), repeat_kv_source(gm, args["value"])
            if k_src is None or v_src is None or k_src[1] != v_src[1]:
                continue
            node.update_arg(1, k_src[0])
            node.update_arg(2, v_src[0])
            n += 1
        if n:
            gm.graph.eliminate_dead_code()  # the repeat chains are unused now
        return match_info(gm, {"grouped_attention": n})


__all__ = [
    "REPEAT_KV_PATTERN",
    "EAGER_ATTENTION_PATTERNS",
    "EAGER_VARIANT_PATTERNS",
    "SDPA_PATTERNS",
    "MaskKind",
    "classify_mask",
    "repeat_kv_source",
]
