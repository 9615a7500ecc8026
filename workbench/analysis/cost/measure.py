"""Measured time of a snapshot's graph on this machine, per op category (torch.profiler).

A snapshot runs here when it can run at all: an uncached graph through ``Workbench.forward``
(graphs from before ``load_weights`` with the eager model's weights bound by name) on
``input_ids [1, s]``; a cached graph through a ``CachedRunner`` over the pipeline's final caches
(``wb.ctx.cache``) with one sequence laid out for the phase (``kv_len`` cached tokens, their
contents whatever the pages hold: timing only). A decode step of an uncached graph re-runs the
whole history (``s = kv_len + 1``), as the runtime's ``UncachedRunner`` does.

The profiler's top-level events (the ops the graph calls, children folded in) are mapped to the
cost model's categories by their names (``aten::linear`` -> matmul, ``workbench::cpu_rmsnorm`` ->
norm); ``wall`` is the whole forward per step, so ``wall - sum`` is the Python and graph overhead
no op event covers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Optional, Union

import torch
import torch.fx as fx

from .categories import category_of
from .devices import torch_threads, wall_time
from .sizes import Phase, is_cached_graph, phase_of


def _event_category(name: str) -> str:
    ns, _, op = name.partition("::")
    if not op:
        return "other"
    return category_of(ns if ns in ("aten", "workbench") else "workbench", op)


def step_function(wb: Any, key: Optional[str], phase: Union[Phase, str]) -> Optional[Callable[[], Any]]:
    """A no-argument function running one step of ``phase`` on the graph of snapshot ``key`` (None:
    the live module), or None when the graph cannot run here (no graph kept, no cache allocated)."""
    p = phase_of(phase)
    snap = wb.snapshot(key) if key is not None else None
    mod = snap.module if snap is not None else wb.module
    if not isinstance(mod, fx.GraphModule):
        return None
    device = wb.ctx.device
    if not is_cached_graph(mod):
        s = p.context if p.name == "decode" else p.tokens
        ids = torch.randint(0, wb.ctx.vocab_size, (p.batch, s), device=device)
        pos = torch.arange(s, device=device).expand(p.batch, s).contiguous()
        return lambda: wb.forward(ids, pos, at=key) if key is not None else wb.forward(ids, pos)
    from ...runtime.runner import CachedRunner

    cache = wb.ctx.cache
    if cache.config is None or not cache.tensors:
        return None
    runner = CachedRunner(mod, cache.tensors, cache.config, device)
    ps = cache.config.page_size
    pages = [list(range(i * -(-p.context // ps), (i + 1) * -(-p.context // ps))) for i in range(p.batch)]
    runner.seq_info.set_batch(
        [[1] * p.tokens for _ in range(p.batch)],
        [p.kv_len] * p.batch,
        pages,
        num_prefill=p.batch if p.name == "prefill" else 0,
        page_size=ps,
    )
    inputs = runner._inputs()

    def run() -> Any:
        with torch.no_grad(), runner.planned():
            return mod(*inputs)

    return run


def measure_categories(
    wb: Any, key: Optional[str], phase: Union[Phase, str] = "decode", steps: int = 3, threads: Optional[int] = None
) -> Optional[Dict[str, float]]:
    """Seconds per step by op category of snapshot ``key``'s graph (mean over ``steps`` profiled
    steps), plus ``wall`` (best unprofiled step); None when the graph cannot run here.
    ``threads``: intra-op threads while measuring (``devices.torch_threads``)."""
    fn = step_function(wb, key, phase)
    if fn is None:
        return None
    per: Dict[str, float] = defaultdict(float)
    with torch_threads(threads):
        wall = wall_time(fn, repeats=steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
    for e in prof.events():
        if e.cpu_parent is None:
            per[_event_category(e.name)] += e.cpu_time_total / 1e6 / steps
    out = dict(per)
    out["wall"] = wall
    return out


__all__ = ["measure_categories", "step_function", "wall_time"]
