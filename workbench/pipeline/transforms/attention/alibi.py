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

How the slopes are read (``alibi_slopes``): every additive position term of the logits (the bias,
the mask) depends on nothing but the sequence length and constants, so its sub-graph is evaluated
at a probe length (``PROBE`` positions, batch 1, on CPU whatever device the graph names) and the sum
is checked to be exactly causal (hidden above the diagonal) and, on the visible part, linear in the
key position with one slope per head. Anything else (padding masks, windows, a bias that is not
linear) is not ALiBi: the pattern does not match and the attention stays as it was.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...graph.weights import fake_value, fetch_attr
from ...matcher import EVAL_DROPOUT, Match, Pattern, named_args, same_size
from ...matcher.masks import evaluate_on_sizes
from ...weights import TensorBinding, record_tensor_binding, tensor_bindings

aten = torch.ops.aten
wb = torch.ops.workbench

#: Sequence length the position terms are evaluated at (small: it is a [n, P, P] evaluation).
PROBE = 12
#: A logit below this (after the position terms are summed) is a hidden key (HF fills finfo.min).
HIDDEN_BELOW = -1e4
#: Root buffers holding slopes are named ``alibi_slopes``, ``alibi_slopes_1``, ... (one per distinct set).
SLOPES_ATTR = "alibi_slopes"

# Sentinels (see pipeline/matcher): values that appear nowhere else in the traced patterns.
_SCALE = 0.3125
_FILL = -1234.5
_N_REP = 3


# ------------------------------------------------------------------------------ reading the slopes


def _size_ancestors(node: fx.Node) -> List[fx.Node]:
    """``node``'s sub-graph in graph order, not followed past ``sym_size`` (the size is all it reads)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is aten.sym_size.int:
            continue
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def evaluate_position_term(node: fx.Node, seq_len: Any, size: int = PROBE) -> Optional[torch.Tensor]:
    """The value of ``node`` when the sequence length is ``size`` and the batch 1, on CPU, or None
    when it depends on anything but sizes and constants (input values, parameters, unknown
    buffers). Sizes equal to ``seq_len`` become ``size``, every other size 1 (the batch)."""
    value = evaluate_on_sizes(_size_ancestors(node), node, seq_len, size)
    return value if isinstance(value, torch.Tensor) else None


def _as_logits(t: torch.Tensor, heads: int, size: int) -> Optional[torch.Tensor]:
    """A position term as [1, heads|1, size|1, size] float64: 4-D as is, 3-D as [b*n, s|1, s]
    (BLOOM's flattened heads; the batch is 1 here), a leading 1 added to [n, s|1, s] otherwise."""
    if t.dim() == 3:
        t = t.reshape(1, -1, *t.shape[1:])
    if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] not in (1, heads) or t.shape[2] not in (1, size):
        return None
    if t.shape[3] != size:
        return None
    return t.double()


def alibi_slopes(
    terms: Sequence[Tuple[fx.Node, float]], q: torch.Tensor, k: torch.Tensor, hidden: Optional[fx.Node] = None
) -> Optional[torch.Tensor]:
    """The ALiBi slopes ``[n]`` (fp32, CPU) of attention logits ``scale * q @ k^T + sum(coef * term)``
    (``terms``: (node, coef)), with ``hidden`` (a bool mask node, True = hidden) on top, or None
    when the position terms are not exactly "causal + ``slope[h] * k_pos`` + a per-row constant".

    ``q`` [b, n, s, d] and ``k`` [b, n_kv, s, d] are the attention's fake values (self-attention:
    same length)."""
    if q.dim() != 4 or k.dim() != 4 or not same_size(q.shape[2], k.shape[2]) or not isinstance(q.shape[1], int):
        return None
    heads, seq_len, size = q.shape[1], q.shape[2], PROBE
    total = torch.zeros(1, 1, size, size, dtype=torch.float64)
    coarsest = torch.float32  # the coarsest dtype a term was computed in sets the tolerance
    for node, coef in terms:
        value = evaluate_position_term(node, seq_len, size)
        if value is None or not value.is_floating_point():
            return None
        t = _as_logits(value, heads, size)
        if t is None:
            return None
        if torch.finfo(value.dtype).eps > torch.finfo(coarsest).eps:
            coarsest = value.dtype
        total = total + coef * t
    if hidden is not None:
        mask = evaluate_position_term(hidden, seq_len, size)
        if mask is None or mask.dtype != torch.bool:
            return None
        mask = mask.reshape(1, *mask.shape[-3:]) if mask.dim() >= 3 else mask
        if mask.dim() != 4 or mask.shape[0] != 1 or tuple(mask.shape[-2:]) != (size, size):
            return None
        total = total.masked_fill(mask, float("-inf"))
    total = total.expand(1, heads, size, size)[0]  # [n, P, P]
    pos = torch.arange(size)
    causal = pos[None, :] <= pos[:, None]
    if not torch.equal(total >= HIDDEN_BELOW, causal.expand_as(total)):
        return None  # hides other keys than the future ones (padding, window, chunk) or none
    last = total[:, -1]  # the last query row sees every key: [n, P]
    slopes = (last[:, -1] - last[:, 0]) / (size - 1)
    if not bool(slopes.ne(0).any()):
        return None  # a plain causal mask (classify_mask's business)
    rel = (pos[None, :] - pos[:, None]).double()  # k_pos - q_pos
    want = total.diagonal(dim1=-2, dim2=-1)[:, :, None] + slopes[:, None, None] * rel  # per-row constant kept
    visible = causal.expand_as(total)
    err = (total - want).abs()[visible].max()
    tol = 8 * torch.finfo(coarsest).eps * max(1.0, float(total[visible].abs().max()))
    if not float(err) <= tol:
        return None
    return slopes.float()


def slopes_constant(*, values: Tuple[float, ...]) -> torch.Tensor:
    """The slopes tensor [n] fp32 of a ``register_slopes`` buffer (its load-time conversion)."""
    return torch.tensor(values, dtype=torch.float32)


def register_slopes(gm: fx.GraphModule, slopes: torch.Tensor) -> str:
    """The root buffer holding ``slopes`` (one per distinct set: every layer of a model shares one),
    registered if new. In a graph that holds no weights yet (traced on meta, before ``load_weights``)
    it is a meta buffer made at load by a declared conversion (``record_tensor_binding`` of
    ``slopes_constant``: no inputs, the values as its static arguments; the unloaded numerics probe
    binds it the same way), so the unloaded graph stays weightless; in a loaded graph, a real buffer
    on the graph's device."""
    values = tuple(float(x) for x in slopes.tolist())
    tensors = [*gm.parameters(), *gm.buffers()]
    bindings = tensor_bindings(gm)
    name, i = SLOPES_ATTR, 0
    while hasattr(gm, name):
        binding = bindings.get(name)
        known = slopes_constant(**dict(binding.kwargs)) if binding is not None else fetch_attr(gm, name)
        if isinstance(known, torch.Tensor) and not known.is_meta and torch.equal(known.cpu().float(), slopes.float()):
            return name
        i += 1
        name = f"{SLOPES_ATTR}_{i}"
    if any(t.is_meta for t in tensors):
        gm.register_buffer(name, torch.empty(len(values), dtype=torch.float32, device="meta"))
        record_tensor_binding(
            gm, name, TensorBinding((), namespace="model", convert=slopes_constant, kwargs=(("values", values),))
        )
    else:
        gm.register_buffer(name, slopes_constant(values=values).to(tensors[0].device if tensors else "cpu"))
    return name


def slopes_node(q: fx.Proxy, slopes: torch.Tensor) -> fx.Proxy:
    """A ``get_attr`` of ``slopes`` (``register_slopes``) recorded into ``q``'s graph, in a pattern
    replacement, with its fake value."""
    gm = q.node.graph.owning_module
    assert isinstance(gm, fx.GraphModule), "slopes_node needs a graph owned by a GraphModule"
    name = register_slopes(gm, slopes)
    proxy = q.tracer.create_proxy("get_attr", name, (), {})
    value = fake_value(gm, fetch_attr(gm, name))
    if value is not None:
        proxy.node.meta["val"] = value
    return proxy


def _alibi_attention(q, k, v, slopes, scale=None):
    """The canonical replacement: causal ``torch_attention`` (bnsd) with the slopes as a graph constant."""
    return wb.torch_attention.default(
        q, k, v, is_causal=True, scale=scale, layout="bnsd", alibi_slopes=slopes_node(q, slopes)
    )


def _qkv_ok(m: Match) -> bool:
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return False
    return not q.shape[1] % k.shape[1] and same_size(k.shape[1], v.shape[1])


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

    def replacement(q, k, v, bias, mask, *, scale, slopes):
        return _alibi_attention(q, k, v, slopes, float(scale))

    def check(m: Match) -> Optional[Dict[str, Any]]:
        if not _qkv_ok(m) or not _cast_back(m, "q"):
            return None
        q, k = m.val("q"), m.val("k")
        if not same_size(q.shape[1], k.shape[1]):
            return None  # the [b*n] views flatten q and k heads alike
        slopes = alibi_slopes([(m.inputs["bias"], 1.0), (m.inputs["mask"], 1.0)], q, k)
        return None if slopes is None else {"slopes": slopes}

    return Pattern(
        f"bloom_alibi_attention{'_dropout' if with_dropout else ''}",
        search,
        replacement,
        _examples("bloom"),
        literals={"scale": _SCALE},
        ignore=((aten.reshape.default, "shape"), (aten.view.default, "size"), (aten.to.dtype, "dtype"), *EVAL_DROPOUT),
        check=check,
        inputs=("q", "k", "v", "bias", "mask"),
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

    def replacement(q, k, v, bias, mask, *, scale, slopes, **_):
        return _alibi_attention(q, k, v, slopes, float(scale))

    def check(m: Match) -> Optional[Dict[str, Any]]:
        (softmax,) = m.matched(aten.softmax.int)  # of the logits cast to fp32; probabilities cast to v's dtype
        if not _qkv_ok(m) or softmax.args[0].args[1] != torch.float32 or not _cast_back(m, "v"):
            return None
        fill = m.literals["fill"]
        if not isinstance(fill, (int, float)) or fill > HIDDEN_BELOW:
            return None
        slopes = alibi_slopes([(m.inputs["bias"], 1.0)], m.val("q"), m.val("k"), hidden=m.inputs["mask"])
        return None if slopes is None else {"slopes": slopes}

    return Pattern(
        f"mpt_alibi_attention{'_dropout' if with_dropout else ''}",
        search,
        replacement,
        _examples("mpt"),
        literals={"scale": _SCALE, "fill": _FILL},
        ignore=((aten.to.dtype, "dtype"), *EVAL_DROPOUT),
        check=check,
        inputs=("q", "k", "v", "bias", "mask"),
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

    def replacement(q, k, v, bias, mask, *, scale, slopes):
        return _alibi_attention(q, k, v, slopes, float(scale))

    def check(m: Match) -> Optional[Dict[str, Any]]:
        if not _qkv_ok(m):
            return None
        if with_cast and m.matched(aten.to.dtype)[0].args[1] != torch.float32:
            return None
        scale = m.literals["scale"]
        if not isinstance(scale, (int, float)):
            return None
        slopes = alibi_slopes([(m.inputs["bias"], float(scale)), (m.inputs["mask"], 1.0)], m.val("q"), m.val("k"))
        return None if slopes is None else {"slopes": slopes}

    return Pattern(
        f"falcon_alibi_eager_attention{'_dropout' if with_dropout else ''}{'_cast' if with_cast else ''}",
        search,
        replacement,
        _examples("falcon"),
        literals={"scale": _SCALE},
        ignore=((aten.view.default, "size"), (aten.softmax.int, "dtype"), (aten.to.dtype, "dtype"), *EVAL_DROPOUT),
        check=check,
        inputs=("q", "k", "v", "bias", "mask"),
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

    def search(q, k, v, mask, n_rep=None):
        if repeated:
            k = wb.torch_attention_repeat_kv.default(k, n_rep)
            v = wb.torch_attention_repeat_kv.default(v, n_rep)
        if source == "aten":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return wb.torch_attention_sdpa.default(q, k, v, mask)

    def replacement(q, k, v, mask, *, scale, slopes, **_):
        return _alibi_attention(q, k, v, slopes, scale)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        if not _qkv_ok(m):
            return None
        flags = dict(named_args(m.outputs[0]))
        if flags["dropout_p"] or flags["is_causal"]:
            return None
        slopes = alibi_slopes([(m.inputs["mask"], 1.0)], m.val("q"), m.val("k"))
        return None if slopes is None else {"slopes": slopes, "scale": flags["scale"]}

    def examples():
        n_kv = 2 if repeated else 6
        return (
            torch.randn(1, 6, 4, 8),
            torch.randn(1, n_kv, 4, 8),
            torch.randn(1, n_kv, 4, 8),
            torch.zeros(1, 6, 4, 4),
        )

    op = aten.scaled_dot_product_attention.default if source == "aten" else wb.torch_attention_sdpa.default
    return Pattern(
        f"{source}_sdpa_alibi{'_repeat_kv' if repeated else ''}",
        search,
        replacement,
        examples,
        literals={"n_rep": _N_REP} if repeated else {},
        ignore=tuple((op, name) for name in ("dropout_p", "is_causal", "scale", "enable_gqa")),
        check=check,
        inputs=("q", "k", "v", "mask"),
    )


#: For ``match_sdpa_to_torch_attention``, before the general SDPA patterns (which would keep the mask).
ALIBI_SDPA_PATTERNS = tuple(
    _sdpa_alibi_pattern(source, repeated)
    for source, repeated in itertools.product(("aten", "workbench"), (True, False))
)


__all__ = [
    "ALIBI_EAGER_PATTERNS",
    "ALIBI_SDPA_PATTERNS",
    "alibi_slopes",
    "evaluate_position_term",
    "register_slopes",
    "slopes_constant",
    "slopes_node",
]
