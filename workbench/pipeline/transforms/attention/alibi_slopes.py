"""ALiBi slopes: read off the position terms of a graph's attention logits, and held by the graph as
a per-head constant (for the ALiBi patterns of ``alibi.py``).

ALiBi adds ``slope[h] * (k_pos - q_pos)`` to head ``h``'s attention logits. HF builds that bias in the
forward from the sequence length and constants; the canonical op carries the slopes instead, as a
buffer ``[n]`` of the graph (``alibi_slopes``) that every attention backend applies from absolute
cache positions.

How the slopes are read (``alibi_slopes``): every additive position term of the logits (the bias,
the mask) depends on nothing but the sequence length and constants, so its sub-graph is evaluated
at a probe length (``PROBE`` positions, batch 1, on CPU whatever device the graph names) and the sum
is checked to be exactly causal (hidden above the diagonal) and, on the visible part, linear in the
key position with one slope per head. Anything else (padding masks, windows, a bias that is not
linear) is not ALiBi: None, and the pattern asking does not match.

How they are held (``register_slopes``, ``slopes_node``): one root buffer per distinct set of slopes,
made at load by a declared conversion (``slopes_constant``) while the graph holds no weights yet.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ...graph.weights import fake_value, fetch_attr
from ...matcher import same_size
from ...matcher.masks import evaluate_on_sizes
from ...weights import TensorBinding, record_tensor_binding, tensor_bindings

aten = torch.ops.aten

#: Sequence length the position terms are evaluated at (small: it is a [n, P, P] evaluation).
PROBE = 12
#: A logit below this (after the position terms are summed) is a hidden key (HF fills finfo.min).
HIDDEN_BELOW = -1e4
#: Root buffers holding slopes are named ``alibi_slopes``, ``alibi_slopes_1``, ... (one per distinct set).
SLOPES_ATTR = "alibi_slopes"


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


__all__ = [
    "HIDDEN_BELOW",
    "PROBE",
    "SLOPES_ATTR",
    "alibi_slopes",
    "evaluate_position_term",
    "register_slopes",
    "slopes_constant",
    "slopes_node",
]
