"""One step of a mixed batch as flattened tokens: the inputs of a cached graph besides the caches.

A step runs B sequences at once: the first ``num_prefill`` contribute a prompt (or a chunk of one),
the rest one decode token each. Their tokens are laid back to back in one row::

    input_ids, position_ids [1, T]   T = sum(seq_lens) <= max_num_tokens
    seq_lens [B] int32               new tokens per sequence
    input_pos [B] int32              tokens already in the cache per sequence
    page_table [B, max_pages_per_seq] int32   page ids per sequence, in logical order
    num_prefill                      int; sequences 0..num_prefill-1 are prefill, the rest decode
    slot_idx [B] int32               each sequence's row of the per-sequence state tensors (SLOT
                                     caches: SSM / conv / delta-rule state); read only by graphs
                                     with such caches
    last_token_index [B] int64       flattened index of each sequence's last new token (read by
                                     graphs that gather before the LM head)

Because every shape is data (T, B) rather than structure, one graph serves prefill, decode and
mixed batches. The tensors are views into buffers allocated once at their maximum size, so their
addresses never change between steps -- the precondition for capturing the graph in a CUDA graph
(which would additionally pad T and B to a few bucket sizes).

Depends on torch and ``ops.step_plan`` only: the pipeline's cache transforms and the runtime both use it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..ops.step_plan import HostStep

TOKEN_INPUTS = ("input_ids", "position_ids")
METADATA_INPUTS = ("seq_lens", "input_pos", "page_table", "num_prefill")
LAST_TOKEN_INPUT = "last_token_index"  # an input only of graphs that gather_logits_before_lm_head
SLOT_INPUT = "slot_idx"  # an input only of graphs with per-sequence state caches (SLOT specs)
# node.meta key on placeholders a cache transform added: the name the runtime feeds it by
# (metadata name or cache resource key). Placeholder names may get suffixes; this key does not.
INPUT_KEY = "wb_cache_input"


class SequenceInfo:
    """Fixed-address input buffers for a cached graph, refilled every step by ``set_batch``."""

    def __init__(
        self, max_batch_size: int, max_num_tokens: int, max_pages_per_seq: int, device: torch.device | str = "cpu"
    ):
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.max_pages_per_seq = max_pages_per_seq
        self.device = torch.device(device)
        i64: Dict[str, Any] = dict(dtype=torch.int64, device=self.device)
        i32: Dict[str, Any] = dict(dtype=torch.int32, device=self.device)
        self._input_ids = torch.zeros(1, max_num_tokens, **i64)
        self._position_ids = torch.zeros(1, max_num_tokens, **i64)
        self._seq_lens = torch.zeros(max_batch_size, **i32)
        self._input_pos = torch.zeros(max_batch_size, **i32)
        self._page_table = torch.zeros(max_batch_size, max_pages_per_seq, **i32)
        self._last_token = torch.zeros(max_batch_size, **i64)
        self._slot_idx = torch.zeros(max_batch_size, **i32)
        # new decode tokens reach _input_ids through a host array: on CPU a numpy view of the buffer
        # itself, on a GPU a pinned staging row copied with one asynchronous transfer per step
        if self.device.type == "cpu":
            self._ids_host = self._input_ids[0]
        else:
            self._ids_host = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._ids_np = self._ids_host.numpy()
        self.num_seqs = self.num_tokens = self.num_prefill = 0
        # what the caller said the current layout is (advance_decode continues only that layout)
        self.layout_key: Optional[Any] = None
        self.seq_lens: List[int] = []
        self.input_pos: List[int] = []
        self.pages: List[List[int]] = []
        self.page_size = 1

    @staticmethod
    def buffer_bytes(max_batch_size: int, max_num_tokens: int, max_pages_per_seq: int) -> int:
        """Bytes ``__init__`` allocates on the device for these sizes: the page table
        ``[max_batch_size, max_pages_per_seq]`` int32, ids and positions ``[1, max_num_tokens]``
        int64, four ``[max_batch_size]`` vectors."""
        return 4 * max_batch_size * max_pages_per_seq + 16 * max_num_tokens + 20 * max_batch_size

    @classmethod
    def from_config(cls, cfg, device: torch.device | str = "cpu") -> "SequenceInfo":
        """Buffers sized for a ``KVCacheConfig``."""
        return cls(cfg.max_batch_size, cfg.max_num_tokens, cfg.max_pages_per_seq, device)

    @property
    def num_decode(self) -> int:
        return self.num_seqs - self.num_prefill

    def set_batch(
        self,
        tokens: Sequence[Sequence[int]],
        input_pos: Sequence[int],
        pages: Sequence[Sequence[int]],
        num_prefill: int,
        page_size: int,
        slots: Optional[Sequence[int]] = None,
        layout_key: Optional[Any] = None,
    ) -> None:
        """Describe the next step: per sequence its new token ids, tokens already cached and pages
        (and its state slot; default: sequence i in slot i, which one-off forwards use).
        ``layout_key``: the caller's name for this layout, which ``advance_decode`` continues.

        Prefill sequences come first (``num_prefill`` of them, any length >= 1), then decode
        sequences (exactly one token). Raises ``ValueError`` naming the sequence that breaks a limit.
        """
        b = len(tokens)
        slots = list(range(b)) if slots is None else list(slots)
        if not (len(input_pos) == len(pages) == len(slots) == b):
            raise ValueError(
                f"tokens, input_pos, pages and slots describe {b}, {len(input_pos)}, {len(pages)}, "
                f"{len(slots)} sequences"
            )
        if b > self.max_batch_size:
            raise ValueError(f"{b} sequences in one step, the buffers hold max_batch_size={self.max_batch_size}")
        if not 0 <= num_prefill <= b:
            raise ValueError(f"num_prefill={num_prefill} outside 0..{b}")
        lens = [len(t) for t in tokens]
        t_total = sum(lens)
        if t_total > self.max_num_tokens:
            raise ValueError(f"{t_total} tokens in one step, the buffers hold max_num_tokens={self.max_num_tokens}")
        flat_ids: List[int] = []
        flat_pos: List[int] = []
        rows = torch.zeros(b, self.max_pages_per_seq, dtype=torch.int32)
        for i, (toks, start, pg) in enumerate(zip(tokens, input_pos, pages)):
            if lens[i] < 1 or (i >= num_prefill and lens[i] != 1):
                kind = "prefill" if i < num_prefill else "decode"
                raise ValueError(f"sequence {i} ({kind}) has {lens[i]} new tokens")
            need = -(-(start + lens[i]) // page_size)
            if len(pg) < need or len(pg) > self.max_pages_per_seq:
                raise ValueError(f"sequence {i} holds {len(pg)} pages, needs {need} (max {self.max_pages_per_seq})")
            flat_ids.extend(toks)
            flat_pos.extend(range(start, start + lens[i]))
            rows[i, : len(pg)] = torch.tensor(pg, dtype=torch.int32)
        # One host tensor per buffer, copied in place: the device addresses never change.
        self._input_ids[0, :t_total].copy_(torch.tensor(flat_ids, dtype=torch.int64), non_blocking=True)
        self._position_ids[0, :t_total].copy_(torch.tensor(flat_pos, dtype=torch.int64), non_blocking=True)
        self._seq_lens[:b].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self._input_pos[:b].copy_(torch.tensor(list(input_pos), dtype=torch.int32), non_blocking=True)
        self._page_table[:b].copy_(rows, non_blocking=True)
        ends = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0) - 1
        self._last_token[:b].copy_(ends, non_blocking=True)
        self._slot_idx[:b].copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        self.num_seqs, self.num_tokens, self.num_prefill = b, t_total, num_prefill
        self.seq_lens, self.input_pos = lens, list(input_pos)
        self.pages, self.page_size = [list(p) for p in pages], page_size
        self.layout_key = layout_key

    def advance_decode(self, tokens: Sequence[int], num_moving: int, layout_key: Any) -> None:
        """The next step of a decode-only layout: the first ``num_moving`` sequences move one
        position on, and every sequence takes its token from ``tokens`` (the rest are padding rows
        that stay where they are). Pages, slots and lengths do not change: the scheduler reserved
        each sequence's pages for its whole life. The hot path of decoding: two in-place adds on the
        device and one transfer of ``len(tokens)`` token ids, no tensor built on the host.

        ``layout_key`` names the new layout; the current one must be a decode-only layout of as many
        sequences set by ``set_batch`` or ``advance_decode`` (else ``ValueError``)."""
        b = len(tokens)
        if self.layout_key is None or self.num_prefill != 0 or b != self.num_seqs or num_moving > b:
            raise ValueError(
                f"advance_decode continues a decode-only layout of {self.num_seqs} sequences "
                f"(num_prefill={self.num_prefill}, keyed: {self.layout_key is not None}); got {b}"
            )
        self._ids_np[:b] = tokens
        if self._ids_host.data_ptr() != self._input_ids.data_ptr():
            self._input_ids[0, :b].copy_(self._ids_host[:b], non_blocking=True)
        self._position_ids[0, :num_moving].add_(1)
        self._input_pos[:num_moving].add_(1)
        self.input_pos[:num_moving] = [p + 1 for p in self.input_pos[:num_moving]]
        self.layout_key = layout_key

    def host_step(self) -> HostStep:
        """The current step's layout as the host knows it (what ops that plan on the host read)."""
        return HostStep.from_lists(self.seq_lens, self.input_pos, self.pages, self.page_size, self.num_prefill)

    def inputs(self) -> Dict[str, Any]:
        """Graph inputs by name for the current step (views of the fixed buffers)."""
        b, t = self.num_seqs, self.num_tokens
        return {
            "input_ids": self._input_ids[:, :t],
            "position_ids": self._position_ids[:, :t],
            "seq_lens": self._seq_lens[:b],
            "input_pos": self._input_pos[:b],
            "page_table": self._page_table[:b],
            "num_prefill": self.num_prefill,
            LAST_TOKEN_INPUT: self._last_token[:b],
            SLOT_INPUT: self._slot_idx[:b],
        }

    def padded_token_inputs(self, num_tokens: int) -> Dict[str, torch.Tensor]:
        """``input_ids``/``position_ids`` [1, num_tokens]: the step's tokens, then padding rows of token
        0 at position 0 (valid for any embedding and RoPE) up to ``num_tokens`` (a CUDA-graph bucket)."""
        if num_tokens < self.num_tokens or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"padding {self.num_tokens} tokens to {num_tokens}: must be in "
                f"[{self.num_tokens}, {self.max_num_tokens}]"
            )
        self._input_ids[0, self.num_tokens : num_tokens].zero_()
        self._position_ids[0, self.num_tokens : num_tokens].zero_()
        return {"input_ids": self._input_ids[:, :num_tokens], "position_ids": self._position_ids[:, :num_tokens]}

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] int64: flattened index of each sequence's last new token (whose logits predict next)."""
        return self._last_token[: self.num_seqs]


def module_input_names(module: torch.nn.Module) -> List[str]:
    """What a cached module takes, in order: token inputs, metadata names and cache resource keys.

    A graph reads them from its placeholders (``meta[INPUT_KEY]`` where a cache transform added
    one); a wrapper module (transformers mode) declares ``input_names``.
    """
    if isinstance(module, torch.fx.GraphModule):
        return [n.meta.get(INPUT_KEY, n.name) for n in module.graph.nodes if n.op == "placeholder"]
    names = getattr(module, "input_names", None)
    if names is not None:
        return list(names)
    inner = next((m for m in module.modules() if isinstance(m, torch.fx.GraphModule)), None)
    return module_input_names(inner) if inner is not None else list(TOKEN_INPUTS)


def is_cached_module(module: torch.nn.Module) -> bool:
    """Whether the module takes the cache metadata inputs (a cache stage has run)."""
    return "seq_lens" in module_input_names(module)


def step_buffer_bytes(cfg) -> int:
    """Bytes of the buffers a runner (or a one-off forward) of the ``KVCacheConfig`` ``cfg``
    allocates on its device: what the cache stage adds to the pool when it checks the limits fit."""
    return SequenceInfo.buffer_bytes(cfg.max_batch_size, cfg.max_num_tokens, cfg.max_pages_per_seq)


__all__ = [
    "step_buffer_bytes",
    "SequenceInfo",
    "TOKEN_INPUTS",
    "METADATA_INPUTS",
    "LAST_TOKEN_INPUT",
    "SLOT_INPUT",
    "INPUT_KEY",
    "module_input_names",
    "is_cached_module",
]
