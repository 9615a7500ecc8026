"""RoPE patterns (stage ``pattern_matcher``): ``match_rope_pattern``.

Three spellings of rotary embeddings become three canonical ops, each rotating q and k together:

* rotate-half with explicit cos/sin (HF Llama family)      -> ``torch_rope_with_explicit_cos_sin``
* DeepSeek's de-interleave + rotate-half                   -> ``torch_rope_with_qk_interleaving``
* complex multiplication by ``freqs_cis`` (Meta Llama/Llama4) -> ``torch_rope_with_complex_freqs``

``unsqueeze_dim`` (where cos/sin get their head axis) is captured from the graph; it is the op's
layout (1: bnsd, 2: bsnd) that ``match_rope_layout`` (layout.py) later adjusts.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import Match, Pattern, PatternMatcher, match_info, named_args, same_size

aten = torch.ops.aten
wb = torch.ops.workbench

_UNSQUEEZE_DIM = 1  # sentinel: the only literal 1 left once slice bounds are ignored


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _rope_explicit(q, k, cos, sin, *, unsqueeze_dim):
    # HF apply_rotary_pos_emb.
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _explicit_replacement(q, k, cos, sin, *, unsqueeze_dim):
    out = wb.torch_rope_with_explicit_cos_sin.default(q, k, cos, sin, unsqueeze_dim)
    return out[0], out[1]


def _rope_interleaved(q, k, cos, sin, *, unsqueeze_dim):
    # HF DeepseekV3 apply_rotary_pos_emb_interleave.
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _interleaved_replacement(q, k, cos, sin, *, unsqueeze_dim):
    out = wb.torch_rope_with_qk_interleaving.default(q, k, cos, sin, unsqueeze_dim)
    return out[0], out[1]


def _rope_complex(shared_unsqueeze: bool):
    def search(xq, xk, freqs_cis, *, unsqueeze_dim):
        # Meta Llama / HF Llama4 apply_rotary_emb; Llama4 indexes freqs_cis[:, :, None, :] once
        # per tensor (two unsqueeze nodes), Meta's reference reshapes it once for both.
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fq = freqs_cis.unsqueeze(unsqueeze_dim)
        fk = fq if shared_unsqueeze else freqs_cis.unsqueeze(unsqueeze_dim)
        xq_out = torch.view_as_real(xq_ * fq).flatten(3)
        xk_out = torch.view_as_real(xk_ * fk).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    return search


def _complex_replacement(xq, xk, freqs_cis, *, unsqueeze_dim):
    out = wb.torch_rope_with_complex_freqs.default(xq, xk, freqs_cis, unsqueeze_dim)
    return out[0], out[1]


def _head_dim(m: Match, q: str, k: str) -> Optional[int]:
    qv, kv = m.val(q), m.val(k)
    if qv is None or kv is None or qv.dim() != 4 or kv.dim() != 4:
        return None
    d = qv.shape[-1]
    return d if isinstance(d, int) and d % 2 == 0 and same_size(kv.shape[-1], d) else None


def _valid_unsqueeze(m: Match, table: str) -> bool:
    t = m.val(table)
    return t is not None and t.dim() == 3 and m.literals["unsqueeze_dim"] in (1, 2)


def _halves_check(m: Match, d: int) -> bool:
    """Every rotate-half slice splits the last dim at d/2: the negated one is [d/2:], the other [:d/2]."""
    negated = {n.args[0] for n in m.matched(aten.neg.default)}
    for node in m.matched(aten.slice.Tensor):
        args = dict(named_args(node))
        x = tensor_meta(node.args[0])
        if x is None or args["dim"] not in (-1, x.dim() - 1) or args["step"] != 1:
            return False
        start, end = (d // 2, None) if node in negated else (0, d // 2)
        if args["start"] != start:
            return False
        if end is None and not (args["end"] is None or args["end"] >= d):
            return False
        if end is not None and args["end"] != end:
            return False
    return True


def _rotate_half_dim(m: Match) -> Optional[int]:
    """The head dim d of a rotate-half match whose tables and halves check out, else None."""
    d = _head_dim(m, "q", "k")
    if d is None or not _valid_unsqueeze(m, "cos") or not _halves_check(m, d):
        return None
    return d


def _rotate_half_check(m: Match) -> Optional[Dict[str, Any]]:
    return None if _rotate_half_dim(m) is None else {}


def _pairs_last(m: Match, op: Any, d: int) -> bool:
    """Every matched ``op`` node gives [..., d/2, 2]: the head dim as pairs."""
    for node in m.matched(op):
        v = tensor_meta(node)
        if v is None or tuple(v.shape[-2:]) != (d // 2, 2):
            return False
    return True


def _interleave_check(m: Match) -> Optional[Dict[str, Any]]:
    d = _rotate_half_dim(m)
    if d is None:
        return None
    # view to [..., d/2, 2], swap the last two dims, merge back to [..., d].
    if not _pairs_last(m, aten.view.default, d):
        return None
    for t in m.matched(aten.transpose.int):
        if sorted(a % 5 for a in t.args[1:3]) != [3, 4]:
            return None
    return {}


def _complex_check(m: Match) -> Optional[Dict[str, Any]]:
    d = _head_dim(m, "xq", "xk")
    if d is None or not _valid_unsqueeze(m, "freqs_cis"):
        return None
    if not _pairs_last(m, aten.reshape.default, d):
        return None
    for f in m.matched(aten.flatten.using_ints):
        if tuple(f.args[1:]) not in ((3,), (3, -1), (-2,), (-2, -1)):
            return None
    return {}


def _qk_cos_sin():
    return torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8)


_SLICE_ARGS = tuple((aten.slice.Tensor, a) for a in ("dim", "start", "end", "step"))

ROPE_PATTERNS = (
    Pattern(
        "rope_qk_interleaving",
        _rope_interleaved,
        _interleaved_replacement,
        _qk_cos_sin,
        literals={"unsqueeze_dim": _UNSQUEEZE_DIM},
        ignore=_SLICE_ARGS + ((aten.view.default, "size"), (aten.reshape.default, "shape")),
        check=_interleave_check,
    ),
    # Traced in fp32 and bf16: in fp32 ``xq.float()`` aliases xq, so export points ``type_as``
    # at the cast instead of at xq -- two spellings of the same code.
    *(
        Pattern(
            f"rope_complex_freqs_{'shared_' if shared else ''}{str(dtype)[6:]}",
            _rope_complex(shared),
            _complex_replacement,
            lambda dtype=dtype: (  # type: ignore[misc]  # a default-bound lambda called with no args
                torch.randn(1, 4, 2, 8, dtype=dtype),
                torch.randn(1, 4, 2, 8, dtype=dtype),
                torch.polar(torch.ones(1, 4, 4), torch.randn(1, 4, 4)),
            ),
            literals={"unsqueeze_dim": 2},
            ignore=(
                (aten.reshape.default, "shape"),
                (aten.flatten.using_ints, "start_dim"),
                (aten.flatten.using_ints, "end_dim"),
            ),
            check=_complex_check,
            inputs=("xq", "xk", "freqs_cis"),
        )
        for dtype in (torch.float32, torch.bfloat16)
        for shared in (False, True)
    ),
    Pattern(
        "rope_explicit_cos_sin",
        _rope_explicit,
        _explicit_replacement,
        _qk_cos_sin,
        literals={"unsqueeze_dim": _UNSQUEEZE_DIM},
        ignore=_SLICE_ARGS,
        check=_rotate_half_check,
    ),
)


# ------------------------------------------------------------------------------ the frequency table


def _table_by_matmul(inv_freq, position_ids):
    # transformers <= 5.17's rotary forward: the angle table as a batched [D/2, 1] @ [1, S] matmul
    expanded = (
        inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(device=inv_freq.device, dtype=torch.float)
    )
    return (expanded @ position_ids[:, None, :].float()).transpose(1, 2)


def _table_by_matmul_casts(inv_freq, position_ids):
    # the same with the extra fp32 casts of transformers <= 5.17's Qwen2/Qwen3 rotary forward
    expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(inv_freq.device)
    return (expanded.float() @ position_ids[:, None, :].float().float()).transpose(1, 2)


def _table_by_mul(inv_freq, position_ids, *, device):
    # transformers >= 5.23's spelling of the same table: a broadcast product. A matmul with an inner
    # dim of 1 computes each entry as one rounded product, so the two are bit-identical in fp32.
    pos = aten.to.dtype(aten.unsqueeze.default(position_ids, 2), torch.float32)
    return aten.mul.Tensor(pos, aten.to.device(inv_freq, device, torch.float32))


def _table_check(m: Match) -> Optional[Dict[str, Any]]:
    inv, pos = m.val("inv_freq"), m.val("position_ids")
    if inv is None or pos is None or inv.dim() != 1 or pos.dim() != 2 or not inv.dtype.is_floating_point:
        return None
    devices = [n.args[1] for n in m.matched(aten.to.device)] + [
        n.kwargs["device"] for n in m.matched(aten.to.dtype_layout) if "device" in n.kwargs
    ]
    return {"device": devices[0]} if devices else None


_TABLE_IGNORE = ((aten.expand.default, "size"), (aten.to.device, "device"), (aten.to.dtype_layout, "device"))
ROPE_TABLE_PATTERNS = tuple(
    Pattern(
        name,
        search,
        _table_by_mul,
        lambda: (torch.rand(4), torch.arange(6).reshape(2, 3)),
        ignore=_TABLE_IGNORE,
        check=_table_check,
    )
    for name, search in (("rope_table_matmul", _table_by_matmul), ("rope_table_matmul_casts", _table_by_matmul_casts))
)


@register("match_rope_pattern")
class MatchRopePattern(Transform):
    """Replace RoPE chains (rotate-half, DeepSeek interleaved, complex freqs) by canonical ops.

    First, the angle table transformers <= 5.17 computes with a matmul is rewritten into the
    broadcast product later versions use (bit-identical), so the canonical graph does not depend
    on the transformers version; those rewrites are reported in ``details['table_rewrites']`` and
    are not counted as RoPE matches.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        tables = sum(PatternMatcher(ROPE_TABLE_PATTERNS).apply(gm).values())
        gm, info = match_info(gm, PatternMatcher(ROPE_PATTERNS).apply(gm), table_rewrites=tables)
        if tables and not info.num_matches:
            gm.graph.lint()
            gm.recompile()
        return gm, info
