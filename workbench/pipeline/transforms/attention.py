"""Attention patterns (stage ``pattern_matcher``): every attention spelling -> ``torch_attention``.

The chain, in pipeline order:

1. ``match_repeat_kv``: HF ``repeat_kv`` (unsqueeze/expand/reshape) -> ``torch_attention_repeat_kv``.
2. ``match_eager_attention``: matmul/softmax/matmul -> ``torch_attention_sdpa``.
3. ``match_sdpa_to_torch_attention``: ``aten.scaled_dot_product_attention`` and
   ``torch_attention_sdpa`` (with or without repeated K/V) -> ``torch_attention`` with native GQA.
   A mask that only encodes causality (HF passes an explicit boolean mask built from aranges) is
   dropped in favour of ``is_causal`` (+ ``sliding_window``), which backends can implement without
   materialising a [s, s] mask.
4. ``match_grouped_attention``: ``torch_attention`` still fed by repeated K/V -> un-repeated K/V.

Layout changes (``match_attention_layout``) live in ``layout.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ... import ops  # noqa: F401  (registers torch.ops.workbench)
from ..interface import Transform, register
from ..matcher import Match, Pattern, PatternMatcher, match_info, named_args, same_shape, same_size
from ..graph_utils import tensor_meta

aten = torch.ops.aten
wb = torch.ops.workbench

# Sentinels (see pipeline/matcher): values that appear nowhere else in the traced patterns.
_N_REP = 3
_SCALE = 0.3125


# ------------------------------------------------------------------------------ repeat_kv


def _repeat_kv(x):
    # HF repeat_kv: [b, n_kv, s, d] -> [b, n_kv * n_rep, s, d]. Traced with n_rep=3 (example 2 -> 6
    # heads); the sizes are ignored and re-derived from shapes in the check.
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, _N_REP, s, d).reshape(b, n_kv * _N_REP, s, d)


def _repeat_kv_replacement(x, *, n_rep):
    return wb.torch_attention_repeat_kv.default(x, n_rep)


def _repeat_kv_check(m: Match) -> Optional[Dict[str, Any]]:
    """The expand really repeats each KV head ``n_rep`` times and the reshape merges exactly that."""
    x = m.val("x")
    (expand,), (reshape,) = m.matched(aten.expand.default), m.matched(aten.reshape.default)
    e, r = tensor_meta(expand), tensor_meta(reshape)
    if x is None or e is None or r is None or x.dim() != 4 or e.dim() != 5:
        return None
    n_rep = e.shape[2]
    if not isinstance(n_rep, int):
        return None
    b, n_kv, s, d = x.shape
    if not same_shape(e.shape, (b, n_kv, n_rep, s, d)):
        return None
    if not same_shape(r.shape, (b, n_kv * n_rep, s, d)):
        return None
    return {"n_rep": n_rep}


REPEAT_KV_PATTERN = Pattern(
    "repeat_kv", _repeat_kv, _repeat_kv_replacement, lambda: (torch.randn(1, 2, 4, 8),),
    ignore=((aten.expand.default, "size"), (aten.reshape.default, "shape")),
    check=_repeat_kv_check,
)


def repeat_kv_source(gm: fx.GraphModule, node: Any) -> Optional[Tuple[fx.Node, int]]:
    """``(x, n_rep)`` if ``node`` repeats KV heads of ``x`` (our op, or the raw HF chain)."""
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
class MatchRepeatKV(Transform):
    """Replace HF's repeat_kv chain by ``torch_attention_repeat_kv(x, n_rep)``."""

    def _apply(self, gm, ctx):
        return match_info(gm, PatternMatcher([REPEAT_KV_PATTERN]).apply(gm))


# ------------------------------------------------------------------------------ eager attention


def _eager_attention(scale_op: str, with_mask: bool, with_dropout: bool) -> Pattern:
    """HF ``eager_attention_forward`` (after repeat_kv): softmax in fp32, cast back, dropout
    (inference: p=0 / training=False; other models skip it)."""

    def search(q, k, v, *mask, scale):
        w = torch.matmul(q, k.transpose(2, 3))
        w = w * scale if scale_op == "mul" else w / scale
        if mask:
            w = w + mask[0]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        if with_dropout:
            w = F.dropout(w, p=0.0, training=False)
        return torch.matmul(w, v)

    def replacement(q, k, v, *mask, scale):
        s = scale if scale_op == "mul" else 1.0 / scale
        return wb.torch_attention_sdpa.default(q, k, v, attn_mask=mask[0] if mask else None, scale=s)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        # The cast after the softmax (dtype ignored in the trace) must return to q's dtype.
        (cast,) = m.matched(aten.to.dtype)
        q = m.val("q")
        if q is None or q.dim() != 4 or cast.args[1] != q.dtype:
            return None
        return {}

    def examples():
        t = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
        return (*t, torch.zeros(1, 1, 4, 4)) if with_mask else t

    return Pattern(
        f"eager_attention_{scale_op}{'_mask' if with_mask else ''}{'_dropout' if with_dropout else ''}",
        search, replacement, examples,
        literals={"scale": _SCALE}, ignore=((aten.to.dtype, "dtype"),), check=check,
        inputs=("q", "k", "v", "attn_mask") if with_mask else ("q", "k", "v"),
    )


EAGER_ATTENTION_PATTERNS = tuple(
    _eager_attention(op, mask, dropout)
    for mask, op, dropout in itertools.product((True, False), ("mul", "div"), (True, False))
)


@register("match_eager_attention")
class MatchEagerAttention(Transform):
    """Replace eager attention (matmul, scale, mask, softmax, matmul) by ``torch_attention_sdpa``."""

    def _apply(self, gm, ctx):
        return match_info(gm, PatternMatcher(EAGER_ATTENTION_PATTERNS).apply(gm))


# ------------------------------------------------------------------------------ causal masks


@dataclass(frozen=True)
class MaskKind:
    """What a position-only mask encodes: nothing (all visible), causal, or causal + window."""

    is_causal: bool
    sliding_window: Optional[int] = None


def _ancestors(node: fx.Node) -> List[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _int_literals(nodes: List[fx.Node]) -> List[int]:
    found = set()
    for n in nodes:
        for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(a, int) and not isinstance(a, bool) and 1 <= a < 2**31:
                found.add(a)
    return sorted(found)


def _on_cpu(a: Any) -> Any:
    return torch.device("cpu") if isinstance(a, torch.device) else a


def classify_mask(mask: fx.Node, seq_len: Any) -> Optional[MaskKind]:
    """Decide whether ``mask`` ([b|1, h|1, s, s]) only encodes causality, by probing it.

    The mask must depend on nothing but the sequence length (``sym_size`` of the inputs): no input
    values, no parameters. Its sub-graph is then evaluated with both position aranges replaced
    by a probe vector of positions (0..9, and around every integer literal of the sub-graph, which
    is where a sliding window's size shows up), and compared with the full, causal and
    causal-sliding-window masks. Anything else (padding masks, prefix-LM, chunked) -> None.
    """
    nodes = _ancestors(mask)
    literals = _int_literals(nodes)
    probe = set(range(10)) | {3_000_000}
    for w in literals:
        probe |= {max(w + d, 0) for d in (-2, -1, 0, 1, 2)} | {2 * w + 1}
    positions = torch.tensor(sorted(probe), dtype=torch.int64)
    n_pos = len(positions)
    env: Dict[fx.Node, Any] = {}
    try:
        for n in nodes:
            if n.op == "placeholder":
                continue
            if n.op != "call_function":
                return None
            if n.target is aten.sym_size.int:
                env[n] = n_pos if same_size(n.meta.get("val"), seq_len) else 1
                continue
            if any(a.op == "placeholder" for a in n.all_input_nodes):
                return None  # depends on input values, not only on sizes
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            # Evaluated on CPU whatever device the graph names (meta when traced device-neutral,
            # cuda when traced there): the mask depends on sizes only, and its verdict must not
            # depend on where the graph will run.
            args, kwargs = fx.node.map_aggregate((args, kwargs), _on_cpu)
            if n.target is aten.arange.default and len(args) == 1 and args[0] == n_pos:
                env[n] = positions
                continue
            env[n] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a mask we cannot evaluate is a mask we keep
        return None
    m = env[mask]
    if not isinstance(m, torch.Tensor) or m.dim() != 4 or tuple(m.shape[-2:]) != (n_pos, n_pos):
        return None
    if m.dtype != torch.bool:
        if not bool(((m == 0) | (m == float("-inf"))).all()):
            return None
        m = m == 0
    m = m.reshape(-1, n_pos, n_pos)
    if not bool((m == m[:1]).all()):
        return None  # differs between batch rows or heads
    m = m[0]
    rel = positions[:, None] - positions[None, :]  # q_pos - k_pos
    if bool(m.all()):
        return MaskKind(is_causal=False)
    if torch.equal(m, rel >= 0):
        return MaskKind(is_causal=True)
    for w in sorted({max(v + d, 1) for v in literals for d in (-1, 0, 1)}):
        if torch.equal(m, (rel >= 0) & (rel < w)):
            return MaskKind(is_causal=True, sliding_window=w)
    return None


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

    def replacement(q, k, v, *mask, keep_mask, dropout_p, is_causal, scale, sliding_window, **_):
        return wb.torch_attention.default(
            q, k, v, attn_mask=mask[0] if mask and keep_mask else None, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, sliding_window=sliding_window, layout="bnsd",
        )

    def check(m: Match) -> Optional[Dict[str, Any]]:
        q, k, v = m.val("q"), m.val("k"), m.val("v")
        if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4:
            return None
        if q.shape[1] % k.shape[1] or not same_size(k.shape[1], v.shape[1]):
            return None
        flags = dict(named_args(m.outputs[0]))
        out = {
            "dropout_p": flags["dropout_p"], "is_causal": bool(flags["is_causal"]),
            "scale": flags["scale"], "sliding_window": None, "keep_mask": with_mask,
        }
        if with_mask and not out["is_causal"] and same_size(q.shape[2], k.shape[2]):
            kind = classify_mask(m.inputs["attn_mask"], q.shape[2])
            if kind is not None:
                out.update(is_causal=kind.is_causal, sliding_window=kind.sliding_window, keep_mask=False)
        return out

    def examples():
        n_kv = 2 if repeated else 6
        t = (torch.randn(1, 6, 4, 8), torch.randn(1, n_kv, 4, 8), torch.randn(1, n_kv, 4, 8))
        return (*t, torch.ones(1, 1, 4, 4, dtype=torch.bool)) if with_mask else t

    return Pattern(
        f"{source}_sdpa{'_repeat_kv' if repeated else ''}{'_mask' if with_mask else ''}",
        search, replacement, examples, literals={"n_rep": _N_REP} if repeated else {},
        ignore=tuple((op, name) for name in _SDPA_FLAGS), check=check,
        inputs=("q", "k", "v", "attn_mask") if with_mask else ("q", "k", "v"),
    )


SDPA_PATTERNS = tuple(
    _sdpa_pattern(source, repeated, with_mask)
    for source, repeated, with_mask in itertools.product(("aten", "workbench"), (True, False), (True, False))
)


@register("match_sdpa_to_torch_attention")
class MatchSDPAToTorchAttention(Transform):
    """Replace SDPA (aten or ``torch_attention_sdpa``), with or without repeat_kv, by
    ``torch_attention`` in bnsd layout; causal-only masks become ``is_causal``/``sliding_window``."""

    def _apply(self, gm, ctx):
        return match_info(gm, PatternMatcher(SDPA_PATTERNS).apply(gm))


# ------------------------------------------------------------------------------ grouped attention


@register("match_grouped_attention")
class MatchGroupedAttention(Transform):
    """Feed ``torch_attention`` the un-repeated K/V wherever it still gets repeated ones.

    Catches what ``match_sdpa_to_torch_attention`` could not see, e.g. repeat_kv matched after it
    or a raw expand/reshape chain. bnsd only: that is the layout repeat_kv repeats in.
    """

    def _apply(self, gm, ctx):
        n = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not wb.torch_attention.default:
                continue
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
    "REPEAT_KV_PATTERN", "EAGER_ATTENTION_PATTERNS", "SDPA_PATTERNS", "MaskKind", "classify_mask",
    "repeat_kv_source",
]
