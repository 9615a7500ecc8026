"""Runners over a compiled forward: ``torch.compile``, CUDA graphs per decode batch size, piecewise.

``compile_model`` builds one of these through a compile backend (``runtime.backends``; capturing
CUDA graphs happens there, so its cost shows in the compile snapshot) and hands it to ``generate``
through ``PipelineContext.runner``. All of them keep
``CachedRunner``'s contract (a scheduled ``Step`` in, next-token logits out) and differ only in
how one forward runs:

* ``CompiledRunner`` -- any callable with the module's signature (``torch.compile(module)``).
* ``CudaGraphRunner`` -- decode-only steps of B sequences replay a graph captured for the smallest
  captured batch size >= B; the missing rows are padding sequences that write their one K/V slot
  into a *scratch page* no real sequence ever owns (the last page of the pool, withheld from the
  scheduler). Prefill/mixed steps and batches above the largest size run the inner forward
  eagerly -- or, with ``piecewise`` (``PiecewiseGraphs``, dual mode), replay graphs captured per
  token bucket between eager attention calls.

A CUDA graph replays fixed kernels on fixed addresses: every input is a view of a buffer of
``SequenceInfo`` (allocated once at its maximum size) or a cache tensor, and the logits come back
in the graph's own output buffer, read before the next replay.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .kv_cache import KVCacheConfig, PageAllocator
from .piecewise import PiecewiseGraphs
from .runner import CachedRunner
from .scheduler import Scheduler, Step
from .static_decode import StaticDecodeGraphs

logger = logging.getLogger("workbench.runtime")

DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def default_batch_sizes(max_batch_size: int) -> List[int]:
    """The captured decode batch sizes when none are configured: small ones densely (most decode
    steps run few sequences), then coarser steps, always including ``max_batch_size`` itself."""
    sizes = [b for b in DEFAULT_CUDA_GRAPH_BATCH_SIZES if b < max_batch_size]
    return sorted(set(sizes + [max_batch_size]))


class CompiledRunner(CachedRunner):
    """A ``CachedRunner`` whose forward is ``fn`` (e.g. ``torch.compile(module, dynamic=True)``)
    instead of the module; one page of the pool is kept as scratch for warm-up and padding."""

    backend = "compiled"

    def __init__(
        self,
        module: torch.nn.Module,
        caches: Mapping[str, torch.Tensor],
        cfg: KVCacheConfig,
        device: torch.device | str,
        fn: Optional[Callable[..., Any]] = None,
        piecewise: Optional[PiecewiseGraphs] = None,
    ):
        if cfg.num_pages < 2:
            raise ValueError("a compiled runner keeps one KV page as scratch: the cache needs >= 2 pages")
        super().__init__(module, caches, cfg, device)
        if fn is not None:
            self.fn = fn
        self.scratch_page = cfg.num_pages - 1
        self.piecewise = piecewise
        self.static_decode: Optional[StaticDecodeGraphs] = None  # set by the backend that builds them

    def forward(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Steps that fit a piecewise token bucket run piecewise, decode steps of a batch size with
        a static decode graph run that graph, the rest through ``fn``."""
        bucket = self.piecewise.bucket(step.num_tokens) if self.piecewise is not None else None
        if bucket is None and self.static_decode is not None and step.num_prefill == 0:
            self.set_step(step, sched)
            inputs = self._inputs()
            graph = self.static_decode.lookup(inputs)
            with torch.no_grad(), self.planned():
                return self.static_decode(graph, inputs) if graph is not None else self.fn(*inputs)
        if bucket is None:
            return super().forward(step, sched)
        assert self.piecewise is not None  # it gave the bucket
        self.set_step(step, sched)
        with self.planned():
            return self.piecewise(self.padded_inputs(bucket), step.num_tokens)

    def pad_rows(self) -> Tuple[int, int]:
        """Padding sequences write their one K/V slot into the scratch page and use the scratch slot."""
        return self.scratch_page, self.cfg.scratch_slot

    def padded_inputs(self, num_tokens: int) -> List[Any]:
        """The module's inputs with the token inputs widened to ``num_tokens`` (the rows past the
        step's tokens are zeroed: token id 0 at position 0, valid for any embedding and RoPE)."""
        return self._inputs(**self.seq_info.padded_token_inputs(num_tokens))

    def scratch_prefill_logits(self, num_tokens: int, fn: Optional[Callable[..., Any]] = None) -> torch.Tensor:
        """Logits [T, V] of a one-sequence prefill of ``num_tokens`` tokens (ids 1..T) on the scratch
        page through the piecewise graphs (default) or ``fn``; ``num_tokens <= page_size``. A graph
        that gathers before the LM head returns the last token's row only: [1, V]."""
        if num_tokens > self.cfg.page_size:
            raise ValueError(f"a scratch prefill fits one page ({self.cfg.page_size} tokens), not {num_tokens}")
        self.seq_info.set_batch(
            [list(range(1, num_tokens + 1))],
            [0],
            [[self.scratch_page]],
            num_prefill=1,
            slots=[self.cfg.scratch_slot],
            page_size=self.cfg.page_size,
        )
        with torch.no_grad(), self.planned():
            if fn is not None:
                out = fn(*self._inputs())
            else:
                assert self.piecewise is not None, "no piecewise graphs: pass fn"
                bucket = self.piecewise.bucket(num_tokens)
                assert bucket is not None, f"no piecewise bucket holds {num_tokens} tokens"
                out = self.piecewise(self.padded_inputs(bucket), num_tokens)
        return out[0, :num_tokens].float().clone()

    def scheduler(self) -> Scheduler:
        """Sequences get every page but the scratch one (capacity checks see the same pool)."""
        pool = self.cfg.with_pages(self.cfg.num_pages - 1)
        return Scheduler(pool, PageAllocator(pool.num_pages))

    def set_scratch_decode(self, batch_size: int, token_id: int = 0) -> None:
        """``batch_size`` decode sequences at position 0, all on the scratch page (warm-up, checks)."""
        self.seq_info.set_batch(
            [[token_id]] * batch_size,
            [0] * batch_size,
            [[self.scratch_page]] * batch_size,
            num_prefill=0,
            page_size=self.cfg.page_size,
            slots=[self.cfg.scratch_slot] * batch_size,
        )

    def scratch_decode_logits(self, batch_size: int, fn: Optional[Callable[..., Any]] = None) -> torch.Tensor:
        """Logits [B, V] of a scratch decode step through ``fn`` (default: this runner's forward)."""
        self.set_scratch_decode(batch_size)
        with torch.no_grad(), self.planned():
            out = (fn or self.fn)(*self._inputs())
        return out[0, :batch_size].float().clone()

    def add_static_decode(
        self, module: torch.nn.Module, batch_sizes: Sequence[int], options: Mapping[str, Any]
    ) -> Dict[str, Any]:
        """Compile ``module`` for decode steps of each of ``batch_sizes`` (``static_decode``) and
        check each graph against ``self.module`` on a scratch decode step; returns the facts."""
        graphs, diffs = None, {}
        for b in sorted(set(batch_sizes)):
            self.set_scratch_decode(b)
            inputs = self._inputs()
            if graphs is None:  # keyed by the shapes of the step's tensors (the caches never change)
                graphs = StaticDecodeGraphs(
                    [
                        i
                        for i, (n, v) in enumerate(zip(self.input_names, inputs))
                        if n not in self.caches and isinstance(v, torch.Tensor)
                    ]
                )
            graphs.add(module, inputs, options)
            got = self.scratch_decode_logits(b, fn=graphs.replay)
            diffs[b] = float((got - self.scratch_decode_logits(b, fn=self.module)).abs().max())
        assert graphs is not None, "no batch sizes given"
        graphs.calls = 0  # counts the steps that ran a static graph, not these checks
        self.static_decode = graphs
        return {"static_decode_batch_sizes": sorted(diffs), "static_decode_check_max_abs_diff": max(diffs.values())}


class CudaGraphRunner(CompiledRunner):
    """Replays one CUDA graph per captured decode batch size; everything else runs ``fn`` eagerly."""

    backend = "cudagraph"

    def __init__(
        self,
        module: torch.nn.Module,
        caches: Mapping[str, torch.Tensor],
        cfg: KVCacheConfig,
        device: torch.device | str,
        batch_sizes: Sequence[int],
        fn: Optional[Callable[..., Any]] = None,
        piecewise: Optional[PiecewiseGraphs] = None,
    ):
        super().__init__(module, caches, cfg, device, fn, piecewise)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        sizes = sorted({int(b) for b in batch_sizes})
        too_big = [b for b in sizes if b > cfg.max_batch_size]
        if too_big:
            raise ValueError(
                f"cuda_graph_batch_sizes {too_big} exceed the KV cache's max_batch_size="
                f"{cfg.max_batch_size}; lower them or raise initialize_cache.max_batch_size"
            )
        self.batch_sizes = sizes
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.replays = self.eager_steps = 0
        self._capture_all()
        if piecewise is not None:
            piecewise.capture(self.padded_inputs)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        for b in sorted(self.batch_sizes, reverse=True):  # largest first: smaller ones reuse its pool
            self.set_scratch_decode(b)
            inputs = self._inputs()
            # one planned step for warm-up and capture: ops that plan on the host (FlashInfer) plan
            # in the warm-up, outside the capture, and the captured kernels read those plans
            with self.planned(graph_batch=b):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream), torch.no_grad():
                    for _ in range(2):  # warm-up off the capture (lazy init, autotuning, compilation)
                        self.fn(*inputs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                    out = self.fn(*inputs)
            self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.synchronize(self.device)

    def bucket(self, num_seqs: int) -> Optional[int]:
        """The smallest captured batch size that holds ``num_seqs`` decode sequences (None: none)."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def replayed_scratch_decode_logits(self, batch_size: int) -> torch.Tensor:
        """Logits [B, V] of a scratch decode step replayed from the graph captured for B's bucket."""
        b = self.bucket(batch_size)
        assert b is not None, f"no captured graph holds batch size {batch_size}"
        self.set_scratch_decode(b)
        self._replay(b)
        return self.outputs[b][0, :batch_size].float().clone()

    def _replay(self, b: int) -> None:
        """Replay the graph of batch size ``b`` on the step in ``seq_info`` (planned first: the
        replay calls no op, so host-planned kernels get this step's plan here)."""
        with self.planned(graph_batch=b):
            self.graphs[b].replay()

    def forward(self, step: Step, sched: Scheduler) -> torch.Tensor:
        b = len(step.items)
        padded = self.bucket(b) if step.num_prefill == 0 else None
        if padded is None:
            if self.piecewise is None or self.piecewise.bucket(step.num_tokens) is None:
                self.eager_steps += 1
            return super().forward(step, sched)
        self.set_step(step, sched, pad_to=padded)
        self._replay(padded)
        self.replays += 1
        return self.outputs[padded][:, :padded]


__all__ = ["CompiledRunner", "CudaGraphRunner", "default_batch_sizes", "DEFAULT_CUDA_GRAPH_BATCH_SIZES"]
