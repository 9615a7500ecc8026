"""The paged KV cache: what each cache tensor looks like, how big the pool is, who owns which page.

Three small pieces, kept apart because they change at different times:

* ``CacheSpec`` -- one cache tensor a cached graph reads (declared by the transform that adds the
  graph input, e.g. ``insert_cached_attention``): its name, kind and per-token (or per-sequence)
  shape. Immutable. Three kinds: ``PAGED`` K/V pages shared by all sequences through page tables;
  ``SLOT`` per-sequence state (SSM / conv / delta-rule state, the mRoPE delta): one row per
  sequence slot, ``[num_slots, *shape]``, whatever the sequence's length; ``PER_TOKEN`` per-step
  buffers (captured hidden states).
* ``KVCacheConfig`` -- the pool's geometry (number of pages, dtype, specs) and the ``RuntimeLimits``
  it was sized for (page size, max sequences, max tokens per sequence, max tokens per step).
  ``initialize_cache`` creates one with conservative capacity; ``resize_kv_cache`` replaces it.
* ``PageAllocator`` -- which pages are free and which sequence holds which; runtime state, created
  fresh for every ``generate`` call so a notebook re-run never inherits stale ownership.

Cache tensors themselves live in ``PipelineContext.resources`` (the stepper reports their bytes as
the memory delta of the transform that created them) and are passed to the graph as inputs.

This module depends on torch only: the pipeline's cache transforms and the runtime both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union, overload

import torch

from .limits import RuntimeLimits

PAGED = "paged"  # [num_pages, page_size, *shape]: K or V of one attention layer
PER_TOKEN = "token"  # [max_num_tokens, *shape]: a per-step buffer (captured hidden states)
SLOT = "slot"  # [num_slots, *shape]: per-sequence recurrent state, one row per sequence slot
CACHE_KINDS = (PAGED, PER_TOKEN, SLOT)


@dataclass(frozen=True)
class CacheSpec:
    """One cache tensor of a cached graph. ``name`` is both the graph input and resource key."""

    name: str
    kind: str  # PAGED | PER_TOKEN
    shape: Tuple[int, ...]  # per-token (PAGED, PER_TOKEN) or per-sequence (SLOT) trailing shape
    dtype: Optional[torch.dtype] = None  # None: the KV-cache dtype of the config
    layer: Optional[int] = None  # decoder layer (for display)

    def __post_init__(self):
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"CacheSpec {self.name}: kind must be one of {CACHE_KINDS}, got {self.kind!r}")

    def token_elems(self) -> int:
        return math.prod(self.shape)

    def tensor_shape(self, cfg: "KVCacheConfig") -> Tuple[int, ...]:
        if self.kind == PAGED:
            return (cfg.num_pages, cfg.page_size, *self.shape)
        if self.kind == SLOT:
            return (cfg.num_slots, *self.shape)
        return (cfg.max_num_tokens, *self.shape)

    def nbytes(self, cfg: "KVCacheConfig") -> int:
        return math.prod(self.tensor_shape(cfg)) * self.resolved_dtype(cfg).itemsize

    def resolved_dtype(self, cfg: "KVCacheConfig") -> torch.dtype:
        return self.dtype or cfg.dtype


class _FromLimits:
    """A read-only ``KVCacheConfig`` attribute that is ``limits.<name>``, read on every access: the
    limits are never copied into the config (a plain class attribute, so not a dataclass field)."""

    def __init__(self, name: str, doc: str):
        self.name = name
        self.__doc__ = doc

    @overload
    def __get__(self, cfg: None, owner: type) -> "_FromLimits": ...

    @overload
    def __get__(self, cfg: "KVCacheConfig", owner: type) -> int: ...

    def __get__(self, cfg: Optional["KVCacheConfig"], owner: type) -> Union[int, "_FromLimits"]:
        return self if cfg is None else getattr(cfg.limits, self.name)


@dataclass(frozen=True)
class KVCacheConfig:
    """Geometry of the paged pool (pages, dtype, specs) and the runtime limits it was sized for:
    ``limits`` is the one holder of page size, max sequences, max tokens per sequence and per step
    (read through the ``_FromLimits`` attributes below, never copied)."""

    limits: RuntimeLimits
    num_pages: int
    dtype: torch.dtype
    specs: Tuple[CacheSpec, ...] = field(default=())

    def __post_init__(self):
        if self.num_pages < 1:
            raise ValueError(f"KVCacheConfig.num_pages must be >= 1, got {self.num_pages}")

    @classmethod
    def sized(
        cls,
        *,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        max_num_tokens: int,
        specs: Sequence[CacheSpec] = (),
    ) -> "KVCacheConfig":
        """A pool with limits of its own (the numerics probe's one-off batch, tests)."""
        limits = RuntimeLimits(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, page_size=page_size
        )
        return cls(limits, num_pages, dtype, tuple(specs))

    page_size = _FromLimits("page_size", "Tokens per page.")
    max_batch_size = _FromLimits("max_batch_size", "Sequences in flight at once (rows of the page table).")
    max_seq_len = _FromLimits("max_seq_len", "Tokens one sequence may hold (prompt + generated).")
    max_num_tokens = _FromLimits("num_tokens", "Flattened tokens per forward step (prefill chunks + decodes).")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def num_slots(self) -> int:
        """Rows of every SLOT state tensor: one per sequence in flight, plus the scratch slot that
        compiled runners' warm-up and padding rows write (never handed to a sequence)."""
        return self.max_batch_size + 1

    @property
    def scratch_slot(self) -> int:
        return self.num_slots - 1

    @property
    def token_capacity(self) -> int:
        """Tokens the whole pool can hold (all sequences together)."""
        return self.num_pages * self.page_size

    @property
    def paged_specs(self) -> Tuple[CacheSpec, ...]:
        return tuple(s for s in self.specs if s.kind == PAGED)

    def bytes_per_page(self) -> int:
        """Bytes one page costs across every paged cache tensor (all layers, K and V)."""
        return sum(self.page_size * s.token_elems() * s.resolved_dtype(self).itemsize for s in self.paged_specs)

    def bytes_per_token(self) -> int:
        return self.bytes_per_page() // self.page_size

    def per_token_bytes(self) -> int:
        """Bytes of the non-paged per-step buffers (independent of ``num_pages``)."""
        return sum(s.nbytes(self) for s in self.specs if s.kind == PER_TOKEN)

    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's SLOT state, all layers and kinds together (independent of its length)."""
        return sum(s.token_elems() * s.resolved_dtype(self).itemsize for s in self.specs if s.kind == SLOT)

    def slot_bytes(self) -> int:
        """Bytes of every SLOT state tensor (``num_slots`` rows each; independent of ``num_pages``)."""
        return self.num_slots * self.state_bytes_per_seq()

    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the page pool: per-step buffers and per-sequence states."""
        return self.per_token_bytes() + self.slot_bytes()

    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page() + self.fixed_bytes()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_to_fill(self) -> int:
        """Pages that hold ``max_batch_size`` sequences of ``max_seq_len``, plus the one scratch page
        compiled runners keep for warm-up and CUDA-graph padding rows: more is never useful."""
        return self.max_batch_size * self.max_pages_per_seq + 1

    def with_pages(self, num_pages: int) -> "KVCacheConfig":
        return replace(self, num_pages=num_pages)

    def summary(self) -> Dict[str, object]:
        return {
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "dtype": str(self.dtype),
            "token_capacity": self.token_capacity,
            "bytes": self.total_bytes(),
            "bytes_per_token": self.bytes_per_token(),
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
            "num_cache_tensors": len(self.specs),
            **(
                {"state_bytes_per_seq": self.state_bytes_per_seq(), "num_slots": self.num_slots}
                if any(s.kind == SLOT for s in self.specs)
                else {}
            ),
        }


def allocate_caches(cfg: KVCacheConfig, device: torch.device) -> Dict[str, torch.Tensor]:
    """Zero-filled cache tensors for every spec.

    Zero, not ``empty``: kernels mask unwritten slots out of the softmax, but a masked probability
    of 0 times a garbage NaN/inf value is still NaN, so pages must hold finite numbers from the start.
    On CPU the zeros come from ``calloc`` (numpy), i.e. from pages the OS zero-fills when they are
    first touched: a cache sized for 64 sequences costs resident memory only for the pages that
    tokens were written to (``torch.zeros`` would write every byte up front).
    """
    return {s.name: _zeros(s.tensor_shape(cfg), s.resolved_dtype(cfg), torch.device(device)) for s in cfg.specs}


_NUMPY_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        import numpy as np

        return torch.from_numpy(np.zeros(tuple(shape), dtype=_NUMPY_DTYPES[dtype]))
    return torch.zeros(shape, dtype=dtype, device=device)


def add_specs(existing: Sequence[CacheSpec], new: Iterable[CacheSpec]) -> Tuple[CacheSpec, ...]:
    """``existing + new``, refusing two different specs under one name."""
    out = {s.name: s for s in existing}
    for s in new:
        if s.name in out and out[s.name] != s:
            raise ValueError(f"cache input {s.name!r} declared twice with different shapes: {out[s.name]} vs {s}")
        out[s.name] = s
    return tuple(out.values())


class CacheFullError(RuntimeError):
    """Not enough free pages for a request (the scheduler waits instead when others hold pages)."""


class SlotAllocator:
    """Free list of state slots (rows of every SLOT tensor), one per sequence in flight.

    Lowest free slot first, so a fresh allocator is deterministic. A slot goes back on the list when
    its sequence finishes and the next sequence may get the very same row: the stateful cached ops
    start every sequence with ``input_pos == 0`` from a zero state, so what the row still holds
    never leaks (the runtime does not need to clear it).
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: List[int] = list(range(num_slots - 1, -1, -1))
        self._owned: Dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, seq_id: int) -> int:
        if seq_id not in self._owned:
            raise KeyError(f"sequence {seq_id} holds no state slot")
        return self._owned[seq_id]

    def allocate(self, seq_id: int) -> int:
        if seq_id in self._owned:
            return self._owned[seq_id]
        if not self._free:
            raise CacheFullError(f"sequence {seq_id} needs a state slot, all {self.num_slots} are taken")
        self._owned[seq_id] = self._free.pop()
        return self._owned[seq_id]

    def free(self, seq_id: int) -> None:
        if seq_id in self._owned:
            self._free.append(self._owned.pop(seq_id))
            self._free.sort(reverse=True)


class PageAllocator:
    """Free list of page ids; page ownership per sequence id.

    Pages are handed out lowest id first, so a fresh allocator gives a deterministic layout (handy
    for tests and for reading page tables in a notebook).
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() from the end: lowest first
        self._owned: Dict[int, List[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages(self, seq_id: int) -> List[int]:
        return self._owned.get(seq_id, [])

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, seq_id: int, n: int) -> List[int]:
        """Give ``seq_id`` ``n`` more pages (appended to the ones it has)."""
        if n > len(self._free):
            raise CacheFullError(f"sequence {seq_id} needs {n} pages, {len(self._free)} of {self.num_pages} are free")
        new = [self._free.pop() for _ in range(n)]
        self._owned.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: int) -> None:
        self._free.extend(self._owned.pop(seq_id, []))
        self._free.sort(reverse=True)


__all__ = [
    "PAGED",
    "PER_TOKEN",
    "SLOT",
    "CACHE_KINDS",
    "SlotAllocator",
    "CacheSpec",
    "KVCacheConfig",
    "allocate_caches",
    "add_specs",
    "PageAllocator",
    "CacheFullError",
]
