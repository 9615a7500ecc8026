"""The concrete sizes a graph's cost is evaluated at: a decode step or a prefill.

Graphs carry symbolic fake values (``node.meta["val"]``): export made batch and sequence dynamic,
the cache transforms added a flat token dimension, per-sequence metadata and cache tensors, each
with its own symbol. The cost of a node depends on those sizes, so a ``Phase`` names them and
``SizeBinding`` maps every symbol of a graph's inputs to an integer; any shape in the graph is then
its sympy expression with the symbols replaced -- no re-propagation, so it is as cheap on a
2,000-node graph as reading the shapes.

What a phase means for each kind of graph (per sequence ``kv_len`` tokens cached before the step):

- uncached graph ``(input_ids [b, s], position_ids) -> logits``: it has no cache, so a decode step
  re-runs the whole history, ``s = kv_len + tokens`` (what ``runtime.UncachedRunner`` does); a
  prefill is ``s = tokens``.
- cached graph (``seq_lens`` among its inputs): ``input_ids [1, T]`` with ``T = batch * tokens``,
  ``seq_lens``/``input_pos`` ``[batch]``, ``page_table [batch, pages]``; the cache tensors keep the
  sizes they were traced with (their hints). How much of the cache an op reads is the op's rule
  (``rules.py``), from ``kv_len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import sympy
import torch
import torch.fx as fx

CACHED_MARKER = "seq_lens"  # a graph with this input is a cached graph (cache stage ran)


@dataclass(frozen=True)
class Phase:
    """One step of generation: ``batch`` sequences, each with ``tokens`` new tokens after
    ``kv_len`` cached ones. ``per`` is what a time is divided by in reports: 1 for a decode step,
    ``tokens`` for a prefill (time per prompt token)."""

    name: str
    tokens: int
    kv_len: int
    batch: int = 1

    @property
    def per(self) -> int:
        return self.tokens * self.batch if self.name == "prefill" else 1

    @property
    def context(self) -> int:
        """Tokens each sequence holds after the step."""
        return self.kv_len + self.tokens


DECODE = Phase("decode", tokens=1, kv_len=511)  # the 512th token: context 512, like the prefill
PREFILL = Phase("prefill", tokens=512, kv_len=0)
PHASES = {"decode": DECODE, "prefill": PREFILL}


def phase_of(phase: "Phase | str") -> Phase:
    if isinstance(phase, Phase):
        return phase
    try:
        return PHASES[phase]
    except KeyError:
        raise ValueError(f"phase {phase!r}: expected one of {sorted(PHASES)} or a Phase") from None


def is_cached_graph(gm: fx.GraphModule) -> bool:
    return any(n.op == "placeholder" and n.target == CACHED_MARKER for n in gm.graph.nodes)


def _hint(sym: sympy.Symbol, shape_env: Any) -> Optional[int]:
    vals = getattr(shape_env, "backed_var_to_val", None)
    if vals is None:  # torch < 2.13
        vals = getattr(shape_env, "var_to_val", None) or {}
    v = vals.get(sym)
    return None if v is None else int(v)


class SizeBinding:
    """Symbol -> integer for one graph at one phase; ``shape(t)`` / ``size(x)`` evaluate fake values.

    ``page_size``: tokens per KV page (from the cache tensors' traced sizes; 1 when the graph has no
    paged cache). Symbols that no input names (data-dependent sizes) take their traced hint, else
    the token count of the step (the usual meaning of an unbacked size: rows selected from tokens).
    """

    def __init__(self, gm: fx.GraphModule, phase: "Phase | str"):
        self.phase = phase_of(phase)
        self.cached = is_cached_graph(gm)
        self.values: Dict[sympy.Symbol, int] = {}
        self.shape_env: Any = None
        self.page_size = 1
        self._memo: Dict[Any, int] = {}
        self.extra: Dict[fx.Node, Any] = {}  # fake values of nodes a transform left without one
        p = self.phase
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            if self.shape_env is None:
                self.shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
            want = self._wanted(str(n.target), val, p)
            for d, w in zip(val.shape, want):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol) and w is not None:
                    self.values.setdefault(d.node.expr, w)
        if self.cached:
            self.page_size = self._page_size(gm)
            for n in gm.graph.nodes:  # page_table [b, pages]: pages of the longest sequence
                if n.op == "placeholder" and n.target == "page_table":
                    d = n.meta["val"].shape[1]
                    if isinstance(d, torch.SymInt):
                        self.values[d.node.expr] = math.ceil(p.context / self.page_size)

        self._fill_missing(gm)

    def _fill_missing(self, gm: fx.GraphModule) -> None:
        """Fake values for call nodes without ``meta["val"]`` (a late transform added them without
        shape propagation), computed from their inputs' values in the graph's fake mode; kept here,
        the snapshot's graph is not touched. A node that fails stays without one (generic rule)."""
        if self.shape_env is None:
            return
        from torch._guards import detect_fake_mode

        from ...pipeline.graph.utils import symbolic_fake_mode

        mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
        if mode is None:
            return
        for n in gm.graph.nodes:
            if n.op != "call_function" or "val" in n.meta:
                continue
            try:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val", self.extra.get(a)))
                with symbolic_fake_mode(mode, cache=False):
                    self.extra[n] = n.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a value we cannot compute leaves the generic rule
                continue

    def _wanted(self, name: str, val: torch.Tensor, p: Phase) -> Tuple[Optional[int], ...]:
        dims = val.dim()
        if name in ("input_ids", "position_ids", "inputs_embeds"):
            if self.cached:
                return (1, p.batch * p.tokens)[:dims]
            s = p.context if p.name == "decode" else p.tokens
            return (p.batch, s)[:dims]
        if self.cached and name in ("seq_lens", "input_pos", "last_token_index", "slot_idx", "page_table"):
            return (p.batch,) + (None,) * (dims - 1)
        return (None,) * dims  # caches and anything else: traced hints

    def _page_size(self, gm: fx.GraphModule) -> int:
        for n in gm.graph.nodes:
            if n.op == "placeholder" and str(n.target).startswith("k_cache"):
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) and val.dim() == 4:
                    return max(self.size(val.shape[1]), 1)
        return 1

    def size(self, d: Any) -> int:
        """An int, SymInt or sympy expression as an int at this phase."""
        if isinstance(d, int):
            return d
        expr = d.node.expr if isinstance(d, torch.SymInt) else sympy.sympify(d)
        if expr in self._memo:
            return self._memo[expr]
        subs = {}
        for s in expr.free_symbols:
            v = self.values.get(s)
            if v is None:
                v = _hint(s, self.shape_env)
            if v is None:
                v = self.phase.batch * self.phase.tokens
            subs[s] = v
        out = int(expr.xreplace(subs)) if subs else int(expr)
        self._memo[expr] = out
        return out

    def shape(self, t: torch.Tensor) -> Tuple[int, ...]:
        return tuple(self.size(d) for d in t.shape)

    def numel(self, t: torch.Tensor) -> int:
        return math.prod(self.shape(t))


__all__ = ["Phase", "DECODE", "PREFILL", "PHASES", "phase_of", "is_cached_graph", "SizeBinding"]
