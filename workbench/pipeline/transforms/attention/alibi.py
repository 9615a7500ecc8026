"""ALiBi attention (BLOOM, MPT, Falcon-RW) -> ``torch_attention(..., alibi_slopes=...)``.

ALiBi adds ``slope[h] * (k_pos - q_pos)`` to head ``h``'s attention logits instead of rotating q/k.
HF builds that bias in the forward from the sequence length and constants (an ``arange`` of key
positions times per-head slopes), adds it to the logits in the family's own way, and masks
causally. Left as it is, the bias is a [b, n, s, s] tensor no KV cache can serve, so every decode
step would re-run the whole sequence. The patterns here recognise each spelling HF uses and read the
slopes off the bias, so the canonical op carries them as a per-head constant ``[n]`` (a buffer of
the graph, ``alibi_slopes``) that every attention backend applies from absolute cache positions.

Spellings (transformers 5.23), all self-attention over the same positions:

* BLOOM (eager only): ``alibi.baddbmm(q, k^T, beta=1, alpha=scale)`` on [b*n, s, d] views, then
  ``+ mask`` (additive causal), fp32 softmax cast back, dropout, ``bmm`` with v -> [b, n, s, d].
  Bias ``slope * k_pos`` (from a ones-mask cumsum or an arange).
* MPT (eager only): ``q @ k^T * scale + position_bias``, ``masked_fill(bool causal mask, min)``,
  softmax of the fp32 logits cast to v's dtype, dropout, ``@ v``. Bias ``slope * (k_pos - max_len
  + 1)`` sliced from a [n, 1, max_seq_len] table (another slope formula: ``alibi_bias_max``).
* Falcon with ``alibi=True``, SDPA (its default): ``sdpa(q, k, v, attn_mask)`` whose float mask is
  the causal mask with ``alibi / sqrt(d)`` folded in (slopes rounded to bf16 first, as HF does).
* Falcon, eager: ``(q @ k^T + alibi) * scale + attn_mask`` where ``attn_mask`` is that same mask
  with ``alibi / sqrt(d)`` in it: the bias enters twice (HF's eager and SDPA paths disagree; the
  pattern reproduces what the eager module computes).

The slopes are read off the bias and the mask, and held by the graph, in ``alibi_slopes.py``: a
spelling whose position terms are not exactly causal ALiBi (padding masks, windows, a bias that is
not linear in the key position) does not match, and the attention stays as it was.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...matcher import EVAL_DROPOUT, Match, Pattern, named_args, same_size
from .alibi_slopes import HIDDEN_BELOW, alibi_slopes, slopes_node
from .variants import SCALE, grouped_qkv, sdpa_pattern

aten = torch.ops.aten
wb = torch.ops.workbench

# Sentinels (see pipeline/matcher): values that appear nowhere else in the traced patterns (the scale's: ``SCALE``).
_FILL = -1234.5


def _alibi_attention(q, k, v, slopes, scale=None):
    """The canonical replacement: causal ``torch_attention`` (bnsd) with the slopes as a graph constant."""
    return wb.torch_attention.default(
        q, k, v, is_causal=True, scale=scale, layout="bnsd", alibi_slopes=slopes_node(q, slopes)
    )


def _cast_back(m: Match, target: str) -> bool:
    """The one cast of the softmax's output returns to ``target``'s dtype (the casts' dtype is
    ignored in the trace; ``Match.matched`` lists nodes in match order, not graph order)."""
    t = m.val(target)
    (softmax,) = m.matched(aten.softmax.int)
    after = [c for c in m.matched(aten.to.dtype) if c.args[0] is softmax]
    return t is not None and len(after) == 1 and after[0].args[1] == t.dtype


def _examples(kind: str):
    """q, k, v [1, 2, 4, 8], then the bias and mask in the family's shapes."""

    def build():
        qkv = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
        if kind == "bloom":
            return (*qkv, torch.randn(2, 1, 4), torch.zeros(1, 1, 4, 4))
        if kind == "mpt":
            return (*qkv, torch.randn(2, 1, 4), torch.zeros(1, 1, 4, 4, dtype=torch.bool))
        return (*qkv, torch.randn(1, 2, 1, 4), torch.zeros(1, 2, 4, 4))  # falcon

    return build


def _eager_alibi_pattern(
    name: str, search, kind: str, slopes_of: Callable[[Match], Optional[torch.Tensor]], *, literals, ignore
) -> Pattern:
    """One eager ALiBi spelling: inputs q, k, v, bias, mask (examples in ``kind``'s shapes), replaced by
    causal ``torch_attention`` with the slopes ``slopes_of(m)`` reads once q/k/v check out (None:
    not this spelling, or not ALiBi). ``ignore``: the spelling's own, dropout's added."""

    def replacement(q, k, v, bias, mask, *, scale, slopes, **_):
        return _alibi_attention(q, k, v, slopes, float(scale))

    def check(m: Match) -> Optional[Dict[str, Any]]:
        slopes = slopes_of(m) if grouped_qkv(m) else None
        return None if slopes is None else {"slopes": slopes}

    return Pattern(
        name,
        search,
        replacement,
        _examples(kind),
        literals=literals,
        ignore=(*ignore, *EVAL_DROPOUT),
        check=check,
        inputs=("q", "k", "v", "bias", "mask"),
    )


# ------------------------------------------------------------------------------ eager spellings


def _bloom_pattern(with_dropout: bool) -> Pattern:
    """BLOOM's ``BloomAttention.forward`` core: baddbmm with the bias, view, mask, softmax, bmm."""

    def search(q, k, v, bias, mask, *, scale):
        b, n, s, d = q.shape
        k3 = k.reshape(b * n, -1, d).transpose(-1, -2)
        w = bias.baddbmm(batch1=q.reshape(b * n, -1, d), batch2=k3, beta=1.0, alpha=scale)
        w = w.view(b, n, s, -1) + mask
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        if with_dropout:
            p = F.dropout(p, p=0.0, training=False)
        out = torch.bmm(p.view(b * n, s, -1), v.reshape(b * n, -1, d))
        return out.view(b, n, s, d)

    def slopes(m: Match) -> Optional[torch.Tensor]:
        q, k = m.val("q"), m.val("k")
        if not _cast_back(m, "q") or not same_size(q.shape[1], k.shape[1]):
            return None  # (heads: the [b*n] views flatten q and k heads alike)
        return alibi_slopes([(m.inputs["bias"], 1.0), (m.inputs["mask"], 1.0)], q, k)

    return _eager_alibi_pattern(
        f"bloom_alibi_attention{'_dropout' if with_dropout else ''}",
        search,
        "bloom",
        slopes,
        literals={"scale": SCALE},
        ignore=((aten.reshape.default, "shape"), (aten.view.default, "size"), (aten.to.dtype, "dtype")),
    )


def _mpt_pattern(with_dropout: bool) -> Pattern:
    """MPT's ``MptAttention.forward`` core: scaled logits plus the sliced bias, the boolean causal
    mask filled in, softmax of the fp32 logits cast to v's dtype, ``@ v``."""

    def search(q, k, v, bias, mask, *, scale, fill):
        w = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
        w = w.masked_fill(mask, fill)
        p = F.softmax(w.float(), dim=-1).to(v.dtype)
        if with_dropout:
            p = F.dropout(p, p=0.0, training=False)
        return torch.matmul(p, v)

    def slopes(m: Match) -> Optional[torch.Tensor]:
        (softmax,) = m.matched(aten.softmax.int)  # of the logits cast to fp32; probabilities cast to v's dtype
        if softmax.args[0].args[1] != torch.float32 or not _cast_back(m, "v"):
            return None
        fill = m.literals["fill"]
        if not isinstance(fill, (int, float)) or fill > HIDDEN_BELOW:
            return None
        return alibi_slopes([(m.inputs["bias"], 1.0)], m.val("q"), m.val("k"), hidden=m.inputs["mask"])

    return _eager_alibi_pattern(
        f"mpt_alibi_attention{'_dropout' if with_dropout else ''}",
        search,
        "mpt",
        slopes,
        literals={"scale": SCALE, "fill": _FILL},
        ignore=((aten.to.dtype, "dtype"),),
    )


def _falcon_eager_pattern(with_dropout: bool, with_cast: bool) -> Pattern:
    """Falcon's eager ALiBi branch: ``(q @ k^T [cast to fp32] + alibi) *= scale``, ``+ attn_mask``
    (which carries ``alibi / sqrt(d)`` again), softmax, dropout, ``@ v``. ``with_cast``: the fp16 /
    bf16 model's logits cast to fp32 before the bias."""

    def search(q, k, v, bias, mask, *, scale):
        b, n, s, _ = q.shape
        w = torch.matmul(q, k.transpose(-1, -2)).view(b, n, s, -1)
        if with_cast:
            w = w.to(torch.float32)
        w = w + bias.view(b, n, 1, -1)
        w *= scale
        p = F.softmax(w + mask, dim=-1, dtype=torch.float32)
        if with_dropout:
            p = F.dropout(p, p=0.0, training=False)
        return torch.matmul(p.view(b, n, s, -1), v)

    def slopes(m: Match) -> Optional[torch.Tensor]:
        if with_cast and m.matched(aten.to.dtype)[0].args[1] != torch.float32:
            return None
        scale = m.literals["scale"]
        if not isinstance(scale, (int, float)):
            return None
        return alibi_slopes([(m.inputs["bias"], float(scale)), (m.inputs["mask"], 1.0)], m.val("q"), m.val("k"))

    return _eager_alibi_pattern(
        f"falcon_alibi_eager_attention{'_dropout' if with_dropout else ''}{'_cast' if with_cast else ''}",
        search,
        "falcon",
        slopes,
        literals={"scale": SCALE},
        ignore=((aten.view.default, "size"), (aten.softmax.int, "dtype"), (aten.to.dtype, "dtype")),
    )


#: For ``match_eager_attention``, before the plain eager patterns.
ALIBI_EAGER_PATTERNS = (
    *(_bloom_pattern(d) for d in (True, False)),
    *(_mpt_pattern(d) for d in (True, False)),
    *(_falcon_eager_pattern(d, c) for d, c in itertools.product((True, False), repeat=2)),
)


# ------------------------------------------------------------------------------ SDPA spelling


def _sdpa_alibi_pattern(source: str, repeated: bool) -> Pattern:
    """SDPA whose float ``attn_mask`` is a causal mask with an ALiBi bias folded in (Falcon)."""

    def replacement(q, k, v, mask, *, scale, slopes, **_):
        return _alibi_attention(q, k, v, slopes, scale)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        if not grouped_qkv(m):
            return None
        flags = dict(named_args(m.outputs[0]))
        if flags["dropout_p"] or flags["is_causal"]:
            return None
        slopes = alibi_slopes([(m.inputs["attn_mask"], 1.0)], m.val("q"), m.val("k"))
        return None if slopes is None else {"slopes": slopes, "scale": flags["scale"]}

    name = f"{source}_sdpa_alibi{'_repeat_kv' if repeated else ''}"
    return sdpa_pattern(name, source, repeated, lambda: torch.zeros(1, 6, 4, 4), replacement, check)


#: For ``match_sdpa_to_torch_attention``, before the general SDPA patterns (which would keep the mask).
ALIBI_SDPA_PATTERNS = tuple(
    _sdpa_alibi_pattern(source, repeated)
    for source, repeated in itertools.product(("aten", "workbench"), (True, False))
)


__all__ = ["ALIBI_EAGER_PATTERNS", "ALIBI_SDPA_PATTERNS"]
