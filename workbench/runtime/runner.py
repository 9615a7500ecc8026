"""Runners: one scheduled ``Step`` in, next-token logits of each sequence out.

``CachedRunner`` drives a cache-enabled module -- the graph after the cache stage, or
``HFCachedLM`` in transformers mode -- through a ``SequenceInfo``: only the new tokens of each
sequence are fed, the K/V of earlier tokens come from the paged caches. ``UncachedRunner`` is the
fallback for a pipeline without a cache stage: every step re-runs each sequence's whole history
through the plain ``(input_ids, position_ids) -> logits`` contract (quadratic, but always right).

Both are ``Runner``s (the protocol ``generate`` is typed against); the compiled runners
(``compiled_runner.py``: torch.compile, CUDA graphs) extend ``CachedRunner`` with the same ``step``
(the fixed-address buffers of ``SequenceInfo`` are what a CUDA graph captures). Which runner a
finished pipeline gets: ``runner_for.py``; the check a cached module passes first: ``cache_check.py``.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

import torch

from ..ops.backends import planners_for
from ..ops.step_plan import planned
from .kv_cache import PAGED, SLOT, KVCacheConfig, PageAllocator
from .scheduler import Scheduler, Step
from .sequence_info import LAST_TOKEN_INPUT, SequenceInfo, module_input_names

logger = logging.getLogger("workbench.runtime")


def describe_caches(cfg: KVCacheConfig) -> str:
    """How a cached runner reaches earlier tokens: "paged KV cache", "per-sequence state", or both."""
    kinds = {s.kind for s in cfg.specs}
    parts = (["paged KV cache"] if PAGED in kinds or not kinds else []) + (
        ["per-sequence state"] if SLOT in kinds else []
    )
    return " + ".join(parts)


class Runner(Protocol):
    """What ``generate`` drives: one scheduled ``Step`` in, each sequence's next-token logits out.
    ``CachedRunner`` (and the compiled runners built on it) and ``UncachedRunner`` are runners."""

    module: torch.nn.Module  # the module it runs (``runner_for`` reuses a runner built for it)
    device: torch.device
    cache_mode: str  # how it reaches earlier tokens, in words ("paged KV cache", "uncached ...")

    def scheduler(self) -> Scheduler:
        """A fresh scheduler over all of its cache."""
        ...

    def step(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Logits of each sequence's last new token: [B, V]."""
        ...


class CachedRunner:
    """Runs steps on a cached module with the caches of a ``KVCacheConfig``."""

    def __init__(
        self,
        module: torch.nn.Module,
        caches: Mapping[str, torch.Tensor],
        cfg: KVCacheConfig,
        device: torch.device | str = "cpu",
    ):
        self.module, self.cfg, self.device = module, cfg, torch.device(device)
        self.input_names = module_input_names(module)
        self.seq_info = SequenceInfo.from_config(cfg, self.device)
        static = set(self.seq_info.inputs())
        missing = [n for n in self.input_names if n not in static and n not in caches]
        if missing:
            raise ValueError(f"no cache tensors for the module inputs {missing}; did initialize_cache run?")
        released = [n for n in self.input_names if n in caches and caches[n].untyped_storage().nbytes() == 0]
        if released:
            raise ValueError(
                f"cache tensors {released[:3]} were released (by resize_kv_cache on a GPU); re-run resize_kv_cache"
            )
        self.caches: Dict[str, torch.Tensor] = {n: caches[n] for n in self.input_names if n in caches}
        # The page ids the runner hands out go up to cfg.num_pages - 1 (the scratch page): a pool
        # tensor with fewer pages would be written past its end by a kernel that trusts them.
        short = [
            f"{s.name} has {self.caches[s.name].shape[0]}"
            for s in cfg.specs
            if s.kind == PAGED and s.name in self.caches and self.caches[s.name].shape[0] < cfg.num_pages
        ]
        if short:
            raise ValueError(
                f"cache tensors hold fewer pages than the cache config's {cfg.num_pages}: {', '.join(short[:3])}; "
                "re-run initialize_cache (and resize_kv_cache) so tensors and config agree"
            )
        self.fn: Callable[..., Any] = module  # what runs a forward; compiled runners swap in a compiled callable
        self.step_form = "module"  # what self.fn is, in words (runner_for says: C++ step program, Python graph)
        self.cache_mode = describe_caches(cfg)
        slot_names = {s.name for s in cfg.specs if s.kind == SLOT}
        self.slot_states = [t for n, t in self.caches.items() if n in slot_names]
        # gather_logits_before_lm_head: the module returns one row per sequence, not per token
        self.gathers_last_tokens = LAST_TOKEN_INPUT in self.input_names
        # ops that plan each step on the host (FlashInfer attention): this runner's own planners
        self.planners = planners_for(module, self.device)
        # the decode layout in the buffers (set_step continues it when the next step is its advance)
        self._layout: Optional[Any] = None
        self.advanced_steps = 0  # decode steps that only advanced the buffers
        # the module's inputs per (sequences, tokens, prefills): views of fixed buffers, built once
        self._input_lists: Dict[Tuple[int, int, int], List[Any]] = {}

    def planned(self, graph_batch: Optional[int] = None):
        """Context for one forward (or the replay of the graph of ``graph_batch``) of the step in
        ``seq_info``: plans it on this runner's planners, which the ops then find."""
        if not self.planners:
            return nullcontext()
        return planned(self.planners, self.seq_info.host_step(), graph_batch)

    def scheduler(self) -> Scheduler:
        """A fresh scheduler over all pages: nothing from an earlier ``generate`` leaks in."""
        return Scheduler(self.cfg, PageAllocator(self.cfg.num_pages))

    def set_step(self, step: Step, sched: Scheduler, pad_to: Optional[int] = None) -> None:
        """Fill the fixed-address ``SequenceInfo`` buffers with the step's new tokens and pages;
        ``pad_to``: add padding sequences up to that many (``pad_rows``: one token at position 0 on
        a scratch page), for a CUDA graph captured for that batch size.

        A decode step of the same sequences as the step before (the common case) only advances
        the buffers (``SequenceInfo.advance_decode``): new token ids in, positions + 1."""
        layout = decode_layout(step, pad_to)
        if layout is not None and self.seq_info.layout_key is self._layout and layout == advanced(self._layout):
            tokens = [r.tokens[r.num_cached] for r, _ in step.items]
            self.seq_info.advance_decode(tokens + [0] * (layout[0] - len(tokens)), len(tokens), layout)
            self.advanced_steps += 1
        else:
            self._set_step_fully(step, sched, pad_to, layout)
        self._layout = layout

    def pad_rows(self) -> Tuple[int, int]:
        """(page, slot) of padding sequences; only runners that keep a scratch page pad."""
        raise ValueError(f"{type(self).__name__} keeps no scratch page to pad a batch with")

    def _set_step_fully(self, step: Step, sched: Scheduler, pad_to: Optional[int], layout: Any) -> None:
        tokens = [r.tokens[r.num_cached : r.num_cached + n] for r, n in step.items]
        fresh = [sched.slot(r) for r, _ in step.items if r.num_cached == 0]
        if fresh and self.slot_states:
            # a new sequence's state rows start at zero: the stateful ops already start from zero at
            # input_pos 0, but per-slot values that are inputs rather than state (the mRoPE delta) must
            # not keep the previous owner's value
            idx = torch.tensor(fresh, device=self.device)
            for t in self.slot_states:
                t.index_fill_(0, idx, 0)
        pos = [r.num_cached for r, _ in step.items]
        pages = [sched.pages(r) for r, _ in step.items]
        slots = [sched.slot(r) for r, _ in step.items]
        pad = (pad_to or 0) - len(step.items)
        if pad > 0:
            page, slot = self.pad_rows()
            tokens, pos, pages, slots = (
                tokens + [[0]] * pad,
                pos + [0] * pad,
                pages + [[page]] * pad,
                slots + [slot] * pad,
            )
        self.seq_info.set_batch(
            tokens,
            pos,
            pages,
            num_prefill=step.num_prefill,
            page_size=self.cfg.page_size,
            slots=slots,
            layout_key=layout,
        )

    def _inputs(self, **overrides: Any) -> List[Any]:
        """The module's positional inputs for the current step: metadata views, then caches
        (``overrides``: other values for some of them by name). The views of a step shape are the
        same every time (fixed buffers), so each shape's list is built once."""
        info = self.seq_info
        key = (info.num_seqs, info.num_tokens, info.num_prefill)
        if not overrides and key in self._input_lists:
            return self._input_lists[key]
        values: Dict[str, Any] = {**info.inputs(), **self.caches, **overrides}
        inputs = [values[n] for n in self.input_names]
        if not overrides:
            self._input_lists[key] = inputs
        return inputs

    def forward(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Logits of the step's flattened tokens [1, T, V], or of each sequence's last token
        [1, B, V] for a module that gathers before the LM head."""
        self.set_step(step, sched)
        with torch.no_grad(), self.planned():
            return self.fn(*self._inputs())

    def step(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Logits of each sequence's last new token: [B, V]."""
        return self.last_token_logits(self.forward(step, sched), len(step.items))

    def last_token_logits(self, logits: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """[B, V] of the module's output for the step in ``seq_info``: its rows of each sequence's
        last new token ([: B]: a CUDA-graph runner pads the batch with scratch rows nobody reads)."""
        if self.gathers_last_tokens:
            return logits[0, :num_seqs]
        return logits[0].index_select(0, self.seq_info.last_token_index)[:num_seqs]


def decode_layout(step: Step, pad_to: Optional[int] = None) -> Optional[Any]:
    """A decode-only step's layout: (padded size, ((request id, tokens cached), ...)); None for a
    step with prefill. Two steps continue each other when ``advanced`` of the first is the second."""
    if step.num_prefill:
        return None
    return (pad_to or len(step.items), tuple((id(r), r.num_cached) for r, _ in step.items))


def advanced(layout: Optional[Any]) -> Optional[Any]:
    """The layout of the next decode step of the same sequences (each one token further)."""
    if layout is None:
        return None
    size, seqs = layout
    return (size, tuple((rid, n + 1) for rid, n in seqs))


class UncachedRunner:
    """Re-forwards every sequence's whole history each step (no cache stage in the pipeline)."""

    cache_mode = "uncached (full re-forward)"

    def __init__(self, module: torch.nn.Module, cfg: KVCacheConfig, device: torch.device | str = "cpu"):
        self.module, self.cfg, self.device = module, cfg, torch.device(device)

    def scheduler(self) -> Scheduler:
        return Scheduler(self.cfg, PageAllocator(self.cfg.num_pages))

    def step(self, step: Step, sched: Scheduler) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            for r, n in step.items:
                ids = torch.tensor(r.tokens[: r.num_cached + n], device=self.device)[None]
                pos = torch.arange(ids.shape[1], device=self.device)[None]
                rows.append(self.module(ids, pos)[0, -1])
        return torch.stack(rows)


__all__ = ["Runner", "CachedRunner", "UncachedRunner", "describe_caches", "decode_layout", "advanced"]
