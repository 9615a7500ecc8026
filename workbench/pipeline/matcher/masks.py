"""What an attention mask in an exported graph encodes, decided by evaluating it on probe positions.

HF builds its masks from ``arange``s of the sequence length (``masking_utils``): a boolean mask for
SDPA, an additive float mask (0 where visible, ``finfo(dtype).min`` where hidden) for the eager
chain. When such a mask only says "causal" (optionally "and within the last ``w`` positions"),
the attention matchers drop it in favour of ``is_causal`` / ``sliding_window``: backends implement
those without materialising an [s, s] mask, and a KV cache can serve them (an explicit mask
cannot). Likewise "causal and within the query's chunk of ``c`` positions" (Llama 4's chunked local
attention, ``masking_utils.chunked_causal_mask_function``) becomes ``chunk_size``. ``attention_mask_arguments`` is the verdict the SDPA and eager patterns share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from ..graph.weights import fetch_attr
from .aliasing import is_view, storage_root, writes_into
from .rewrite import same_size

aten = torch.ops.aten


@dataclass(frozen=True)
class MaskKind:
    """What a position-only mask encodes: nothing (all visible), causal, causal + window, or causal
    + chunk (keys of the query's own chunk of ``chunk_size`` absolute positions)."""

    is_causal: bool
    sliding_window: Optional[int] = None
    chunk_size: Optional[int] = None


def _closure(starts: List[fx.Node], seen: set) -> None:
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)


def _ancestors(node: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes ``node``'s value is computed from, in graph order -- including the in-place writes
    into any of them (``m[:, 1::2] = True`` is a ``fill_`` into a view of ``m`` that is nobody's
    input) and what those writes read. None when a write into that memory comes after the mask is
    first read: its value then depends on where it is read, and nothing is proven. Walks the
    mask's own sub-graph and the users of its memory, never the whole graph (one call per
    attention layer)."""
    seen: set = set()
    _closure([node], seen)
    writes_of: Dict[fx.Node, List[fx.Node]] = {}  # storage root -> its writes, found once each
    while True:
        for root in {storage_root(n) for n in seen} - set(writes_of):
            writes_of[root] = writes_into(root)
        more = {w for ws in writes_of.values() for w in ws} - seen
        if not more:
            break
        _closure(list(more), seen)
    writes = [w for ws in writes_of.values() for w in ws]
    if writes:
        written = {r for r, ws in writes_of.items() if ws}
        readers = [u for n in seen if storage_root(n) in written for u in n.users if u not in seen and not is_view(u)]
        if readers and max(writes) > min(readers):  # fx nodes compare by graph order
            return None  # written after it is first read
    return sorted(seen)


def _int_literals(nodes: List[fx.Node]) -> List[int]:
    found = set()
    for n in nodes:
        for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(a, int) and not isinstance(a, bool) and 1 <= a < 2**31:
                found.add(a)
    return sorted(found)


def _on_cpu(a: Any) -> Any:
    return torch.device("cpu") if isinstance(a, torch.device) else a


# An additive mask entry at or below this hides its key: its softmax weight exp(logit + HIDDEN -
# max) underflows to exactly 0 in every float dtype (fp32 underflows below exp(-104)) for any
# logit spread short of ~65,000, so dropping it for is_causal changes no bit. It covers -inf, every
# dtype's finfo.min (HF's eager masks; Llama 3.1's bf16 min kept in an fp32 mask), fp16's -65504
# and -1e9. Smaller fills (-1e4, -5000) are kept as the biases they may be meant as.
HIDDEN = -65504.0


def _visible(m: torch.Tensor) -> Optional[torch.Tensor]:
    """Boolean "may attend" of an evaluated mask: a bool mask as is; an additive float mask when
    every entry is 0 (visible) or hidden (<= ``HIDDEN``: adding it to a finite logit leaves a logit
    whose softmax weight is exactly 0, like -inf, provided a row keeps one visible key, which causal
    rows do). Anything else: None."""
    if m.dtype == torch.bool:
        return m
    if not m.is_floating_point():
        return None
    hidden = m <= HIDDEN
    if not bool(((m == 0) | hidden).all()):
        return None
    return m == 0


# The largest constant table a mask may be evaluated from (a [1, 1, 2048, 2048] causal table: 4 M).
_TABLE_ELEMENTS = 1 << 24


def constant_tensor(node: fx.Node) -> Optional[torch.Tensor]:
    """The value of a ``get_attr`` that reads a real tensor that is not a parameter, else None.
    Export registers the literals it lifts as buffers; traced on meta, the model's own buffers are
    meta (value unknown: None) until ``load_weights``, after which a registered table (GPT-Neo's
    causal ``bias``) is as constant as a literal."""
    gm = node.graph.owning_module
    if gm is None:
        return None
    value = fetch_attr(gm, node.target)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return None
    if value.is_meta or value.numel() > _TABLE_ELEMENTS:
        return None
    return value.cpu()


def _table_size(nodes: List[fx.Node]) -> Optional[int]:
    """The last dim of the largest constant table (a non-0-dim buffer with a value) the mask reads."""
    sizes = [
        v.shape[-1] for n in nodes if n.op == "get_attr" for v in [constant_tensor(n)] if v is not None and v.dim() >= 2
    ]
    return max(sizes) if sizes else None


def evaluate_on_sizes(
    nodes: List[fx.Node], target: fx.Node, seq_len: Any, size: int, positions: Optional[torch.Tensor] = None
) -> Any:
    """The value of ``target`` computed from its sub-graph ``nodes`` (graph order) on CPU, with every
    size equal to ``seq_len`` set to ``size`` and every other size to 1 (the batch); ``positions``
    (``size`` of them) stands for ``arange(size)``. None when the sub-graph reads anything but sizes
    and literal constants (input values, parameters, unknown buffers) or fails to evaluate.

    Evaluated on CPU whatever device the graph names (meta when traced device-neutral, cuda when
    traced there): a term that depends on sizes only must not get its verdict from where the graph
    will run."""
    env: Dict[fx.Node, Any] = {}
    try:
        for n in nodes:
            if n.op == "placeholder":
                continue  # read only through sym_size (anything else is rejected below)
            if n.op == "get_attr":  # a literal export lifted (transformers 5.17: torch.tensor(0.0))
                value = constant_tensor(n)
                if value is None:
                    return None
                env[n] = value
                continue
            if n.op != "call_function":
                return None
            if n.target is aten.sym_size.int:
                env[n] = size if same_size(n.meta.get("val"), seq_len) else 1
                continue
            if any(a.op == "placeholder" for a in n.all_input_nodes):
                return None  # depends on input values, not only on sizes
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            args, kwargs = fx.node.map_aggregate((args, kwargs), _on_cpu)
            if positions is not None and n.target is aten.arange.default and len(args) == 1 and args[0] == size:
                env[n] = positions
                continue
            env[n] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a term we cannot evaluate is one we do not recognise
        return None
    return env.get(target)


def classify_mask(mask: fx.Node, seq_len: Any) -> Optional[MaskKind]:
    """Decide whether ``mask`` ([b|1, h|1, s, s], [h|1, s, s] or [s, s]) only encodes causality, by probing it.

    The mask must depend on nothing but the sequence length (``sym_size`` of the inputs): no input
    values, no parameters. Its sub-graph is then evaluated with both position aranges replaced
    by a probe vector of positions (0..9, and around every integer literal of the sub-graph, which
    is where a sliding window's size shows up), and compared with the full, causal and
    causal-sliding-window and causal-chunked masks (a chunk's size, like a window's, is one of the
    literals). A mask read from a constant table the model registered (known once the weights are
    loaded) is evaluated over the whole table instead (``_classify_by_index``). Anything else
    (padding masks, prefix-LM) -> None.
    """
    nodes = _ancestors(mask)
    if nodes is None:
        return None
    # A mask read from a table is indexed by position (a window narrower than the table but wider
    # than the probe would pass for causal there): it is evaluated whole instead.
    table = _table_size(nodes)
    if table is not None:
        return _classify_by_index(nodes, mask, seq_len, table)
    return _classify_by_positions(nodes, mask, seq_len)


def _classify_by_index(nodes: List[fx.Node], mask: fx.Node, seq_len: Any, table: int) -> Optional[MaskKind]:
    """A mask sliced from a registered table ([..., P, P], indexed by position): evaluated at the
    table's full size P with positions 0..P-1 (a table knows no other positions, and a window as
    wide as a smaller probe would look causal), then full, causal, or causal within the last ``w``
    positions (``w`` read off its last row)."""
    m = evaluate_on_sizes(nodes, mask, seq_len, table)
    visible = _visible(m) if isinstance(m, torch.Tensor) and tuple(m.shape[-2:]) == (table, table) else None
    window = int(visible.reshape(-1, table, table)[0, -1].sum()) if visible is not None else 0
    return _compare(m, torch.arange(table), [window] if 1 <= window < table else [])


def _classify_by_positions(nodes: List[fx.Node], mask: fx.Node, seq_len: Any) -> Optional[MaskKind]:
    """Evaluated on probe positions (0..9, around every integer literal, 3,000,000); where that cannot
    evaluate -- a padding mask of ones made in forward and indexed by key position (BioGPT) reads
    out of range at probe positions -- on positions 0..n-1 with n past twice every literal (a
    window or chunk size is one)."""
    literals = _int_literals(nodes)
    probe = set(range(10)) | {3_000_000}
    for w in literals:
        probe |= {max(w + d, 0) for d in (-2, -1, 0, 1, 2)} | {2 * w - 1, 2 * w, 2 * w + 1}
    positions = torch.tensor(sorted(probe), dtype=torch.int64)
    m = evaluate_on_sizes(nodes, mask, seq_len, len(positions), positions)
    if m is not None:
        return _compare(m, positions, literals)
    n = min(max(16, 2 * max(literals, default=0) + 3), 4096)
    return _compare(evaluate_on_sizes(nodes, mask, seq_len, n), torch.arange(n), literals)


def _compare(m: Any, positions: torch.Tensor, sizes: List[int]) -> Optional[MaskKind]:
    """``m`` (an evaluated mask over ``positions`` x ``positions``) as full, causal, causal within a
    window, or causal within a chunk, the window or chunk one of ``sizes`` (+-1); else None."""
    n_pos = len(positions)
    if not isinstance(m, torch.Tensor) or not 2 <= m.dim() <= 4 or tuple(m.shape[-2:]) != (n_pos, n_pos):
        return None
    m = _visible(m)
    if m is None:
        return None
    m = m.reshape(-1, n_pos, n_pos)
    if not bool((m == m[:1]).all()):
        return None  # differs between batch rows or heads
    m = m[0]
    rel = positions[:, None] - positions[None, :]  # q_pos - k_pos
    if bool(m.all()):
        return MaskKind(is_causal=False)
    if torch.equal(m, rel >= 0):
        return MaskKind(is_causal=True)
    candidates = sorted({max(v + d, 1) for v in sizes for d in (-1, 0, 1)})
    for w in candidates:
        if torch.equal(m, (rel >= 0) & (rel < w)):
            return MaskKind(is_causal=True, sliding_window=w)
    for c in candidates:
        chunk = positions // c
        if torch.equal(m, (rel >= 0) & (chunk[:, None] == chunk[None, :])):
            return MaskKind(is_causal=True, chunk_size=c)
    return None


def attention_mask_arguments(
    mask: Optional[fx.Node], q: torch.Tensor, k: torch.Tensor, is_causal: bool = False
) -> Dict[str, Any]:
    """``torch_attention``'s masking arguments for an attention of ``q`` [b, n, s_q, d] over
    ``k`` [b, n_kv, s_k, d] with ``mask`` (None: no mask): ``is_causal``, ``sliding_window``,
    ``chunk_size`` and ``keep_mask`` (whether the explicit mask must stay). A mask is only dropped for what it
    provably encodes, and only for self-attention over the same positions (s_q == s_k)."""
    out: Dict[str, Any] = {
        "is_causal": bool(is_causal),
        "sliding_window": None,
        "chunk_size": None,
        "keep_mask": mask is not None,
    }
    if mask is not None and not is_causal and same_size(q.shape[2], k.shape[2]):
        kind = classify_mask(mask, q.shape[2])
        if kind is not None:
            out.update(
                is_causal=kind.is_causal,
                sliding_window=kind.sliding_window,
                chunk_size=kind.chunk_size,
                keep_mask=False,
            )
    return out


__all__ = ["MaskKind", "classify_mask", "attention_mask_arguments", "constant_tensor"]
