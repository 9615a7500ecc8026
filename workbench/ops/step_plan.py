"""Host-side plans of a step, for ops whose kernels need a schedule made on the CPU.

FlashInfer's paged attention runs kernels whose work partition ``plan()`` computes on the host from
the step's sequence lengths and page lists; ``plan()`` cannot run inside a CUDA graph, and a
replayed graph never calls the op at all. So the runtime, which knows each step's layout on the
host before it touches the device, plans for the op:

    planners = planners_for(module, device)      # ops/backends.py, once per runner: {backend name: planner}
    with planned(planners, seq_info.host_step(page_size), graph_batch=None):
        logits = module(*inputs)                 # the op finds its planner: active_planner("flashinfer")
    ...
    with planned(planners, host_step, graph_batch=b):
        graph[b].replay()                        # begin() re-planned every wrapper graph b captured

A planner belongs to one runner (no process-wide state); the active set is a ``ContextVar``, so two
threads running two workbenches never see each other's plans. Ops called outside a runner (the
numerics probe, a direct call in a test) get no planner and plan from the device tensors
themselves, which synchronises with the device -- fine eagerly, refused under capture.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Protocol, Sequence, Tuple

import torch


@dataclass(frozen=True)
class HostStep:
    """One step's layout as the host knows it: per sequence its new tokens, tokens already cached
    and pages (logical order); sequences ``0..num_prefill-1`` are prefill, the rest decode."""

    seq_lens: Tuple[int, ...]
    input_pos: Tuple[int, ...]
    pages: Tuple[Tuple[int, ...], ...]
    page_size: int
    num_prefill: int

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @classmethod
    def from_lists(
        cls,
        seq_lens: Sequence[int],
        input_pos: Sequence[int],
        pages: Sequence[Sequence[int]],
        page_size: int,
        num_prefill: int,
    ) -> "HostStep":
        return cls(
            tuple(int(n) for n in seq_lens),
            tuple(int(p) for p in input_pos),
            tuple(tuple(int(x) for x in p) for p in pages),
            int(page_size),
            int(num_prefill),
        )

    @classmethod
    def from_device(
        cls, seq_lens: torch.Tensor, input_pos: torch.Tensor, page_table: torch.Tensor, page_size: int, num_prefill: int
    ) -> "HostStep":
        """Read from the op's metadata tensors (a device -> host copy: a synchronisation)."""
        lens, past = seq_lens.tolist(), input_pos.tolist()
        rows = page_table[: len(lens)].tolist()
        pages = [row[: -(-(p + n) // page_size)] for row, p, n in zip(rows, past, lens)]
        return cls.from_lists(lens, past, pages, page_size, num_prefill)


class StepPlanner(Protocol):
    """What a runner drives: ``begin`` with each step's host layout before the forward (or the
    replay of the graph captured for batch size ``graph_batch``)."""

    def begin(self, step: HostStep, graph_batch: Optional[int]) -> None: ...


_ACTIVE: ContextVar[Mapping[str, StepPlanner]] = ContextVar("workbench_step_planners", default=MappingProxyType({}))


@contextmanager
def planned(planners: Mapping[str, StepPlanner], step: HostStep, graph_batch: Optional[int] = None) -> Iterator[None]:
    """Plan ``step`` on every planner, and make them the ones the ops find while the block runs."""
    for planner in planners.values():
        planner.begin(step, graph_batch)
    token = _ACTIVE.set(planners)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_planner(kind: str) -> Optional[StepPlanner]:
    """The planner of backend ``kind`` the current runner made active (None outside a runner)."""
    return _ACTIVE.get().get(kind)


__all__ = ["HostStep", "StepPlanner", "planned", "active_planner"]
