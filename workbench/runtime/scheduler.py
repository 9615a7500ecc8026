"""Continuous batching: which sequences run in the next step, and with how many tokens.

Every step is one forward over a mixed batch (see ``SequenceInfo``): running decodes first claim
one token each, then prefills (a prompt, or the next chunk of a long one) fill the remaining
``max_num_tokens`` budget, and waiting requests join whenever a sequence slot and the pages they
need are free -- so new prompts start while others are mid-decode, and a finished sequence's slot
and pages go to the next prompt on the very next step.

A sequence with per-sequence state (SSM / conv / delta-rule caches) also holds one state slot from
admission to finish (``SlotAllocator``): at most ``max_batch_size`` run at once, so a slot is always
free for an admitted sequence, and a finished sequence's slot is reused by the next one.

Pages are reserved for a request's whole life when it is admitted (prompt + max_new_tokens,
capped at ``max_seq_len``): a running sequence can then never run out of cache, and no
preemption/recompute machinery is needed. The price is admitting fewer sequences than on-demand
allocation would when most stop early; requests that do not fit wait in FIFO order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, FrozenSet, List, Optional, Tuple

from .kv_cache import KVCacheConfig, PageAllocator, SlotAllocator
from .sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One prompt's life: its tokens (prompt + generated), cache progress and outcome."""

    index: int  # position in the caller's prompt list
    prompt: List[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: FrozenSet[int] = frozenset()
    tokens: List[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: Optional[str] = None  # "stop" | "length" | "error"
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    first_token_s: Optional[float] = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> List[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens


@dataclass
class Step:
    """One forward: ``items`` are (request, new tokens) with prefills first, then decodes."""

    items: List[Tuple[Request, int]]
    num_prefill: int

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def num_decode(self) -> int:
        return len(self.items) - self.num_prefill


class Scheduler:
    def __init__(self, cfg: KVCacheConfig, allocator: Optional[PageAllocator] = None):
        self.cfg = cfg
        self.allocator = allocator or PageAllocator(cfg.num_pages)
        # every row but the scratch one (kept for compiled runners' padding rows)
        self.slots = SlotAllocator(cfg.num_slots - 1)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []

    def capacity(self) -> int:
        """Most tokens (prompt + generated) one sequence can ever hold."""
        return min(self.cfg.max_seq_len, self.cfg.token_capacity)

    def add(self, req: Request) -> None:
        if req.reserve_tokens > self.capacity():
            raise ValueError(
                f"request {req.index} needs {req.reserve_tokens} tokens, the cache holds {self.capacity()} per sequence"
            )
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        budget = self.cfg.max_num_tokens
        decode = [r for r in self.running if not r.in_prefill][:budget]
        budget -= len(decode)
        prefill: List[Tuple[Request, int]] = []
        for r in self.running:
            if r.in_prefill and budget > 0:
                n = min(len(r.prompt) - r.num_cached, budget)
                prefill.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_batch_size:
            req = self.waiting[0]
            pages = self.cfg.pages_for(req.reserve_tokens)
            if not self.allocator.can_allocate(pages):
                break  # FIFO: later requests do not overtake the head
            self.waiting.popleft()
            self.allocator.allocate(id(req), pages)
            self.slots.allocate(id(req))
            self.running.append(req)
            n = min(len(req.prompt), budget)
            prefill.append((req, n))
            budget -= n
        return Step(items=prefill + [(r, 1) for r in decode], num_prefill=len(prefill))

    def pages(self, req: Request) -> List[int]:
        return self.allocator.pages(id(req))

    def slot(self, req: Request) -> int:
        """The request's row of the per-sequence state tensors."""
        return self.slots.slot(id(req))

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self.allocator.free(id(req))
            self.slots.free(id(req))


__all__ = ["Request", "Step", "Scheduler"]
