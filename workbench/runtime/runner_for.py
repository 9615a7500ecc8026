"""``runner_for``: the runner of a finished pipeline -- the one ``compile_model`` built, or the plain
cached runner (a C++ step program on CPU), or the uncached fallback -- behind the cache check."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Protocol, Tuple

import torch

from ..errors import InputError
from .cache_check import check_cache_carries_past
from .kv_cache import KVCacheConfig
from .lean_graph import lean_copy
from .limits import RuntimeLimits
from .runner import CachedRunner, Runner, UncachedRunner
from .sequence_info import is_cached_module
from .step_program import build as build_step_program

logger = logging.getLogger("workbench.runtime")


class CacheView(Protocol):
    """The caches a finished pipeline allocated (``PipelineContext.cache``)."""

    config: Optional[KVCacheConfig]

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...  # read-only: a dict attribute satisfies it


class RunnerSource(Protocol):
    """What ``runner_for`` reads of a finished pipeline (a ``PipelineContext`` is one; the runtime
    never imports the pipeline): the compiled runner if one was built, the caches, the limits, and
    where and in which dtype the model runs."""

    runner: Optional["CachedRunner"]

    @property
    def cache(self) -> CacheView: ...  # read-only: a CacheState attribute satisfies it

    limits: RuntimeLimits
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int: ...  # read-only: a property of the context


def plain_step(module: torch.nn.Module, device: torch.device) -> Tuple[Callable[..., Any], str]:
    """What the plain runner calls for a step, and what that is in words: on CPU the graph as a C++
    step program (no Python per node, ``step_program.py``), else -- or where the graph has a node
    the program cannot express -- the lean Python copy (``lean_graph.py``). Both run the graph's
    operators with the same arguments in the same order: the same results bit for bit."""
    why = "runs on CUDA: its own runners (CUDA graphs, torch.compile) replace the Python step"
    if torch.device(device).type == "cpu":
        program, why = build_step_program(module)
        if program is not None:
            return program, f"C++ step program ({program.num_calls} calls a step)"
    logger.info("the plain runner steps the graph from Python: %s", why)
    return lean_copy(module), f"Python graph ({why})"


def runner_for(module: torch.nn.Module, ctx: RunnerSource) -> Runner:
    """The runner for a pipeline's final module and its context (``RunnerSource``).

    ``compile_model`` leaves its runner (torch.compile, CUDA graphs) in ``ctx.runner``; it is used
    when it was built for this very module, otherwise the plain runner is built here. A cached
    module must pass ``check_cache_carries_past`` first (an ``InputError`` otherwise): no runner
    claims a cache the graph does not have.
    """
    cached = is_cached_module(module)
    if cached:
        cfg = ctx.cache.config
        if cfg is None:
            raise InputError(
                "generation refused: the model takes cache inputs but no KV cache was allocated: enable "
                "initialize_cache (and resize_kv_cache) in the cache_init stage"
            )
        check_cache_carries_past(module, cfg, ctx.device, ctx.vocab_size, ctx.dtype)
    built = ctx.runner
    if built is not None:
        if built.module is module:
            return built
        logger.warning("the compiled runner was built for another module: running %s eagerly", type(module).__name__)
    if cached:
        assert cfg is not None
        runner = CachedRunner(module, ctx.cache.tensors, cfg, ctx.device)
        runner.fn, runner.step_form = plain_step(module, ctx.device)
        return runner
    logger.warning("no cache stage ran: generating without a KV cache (every step re-runs the whole sequence)")
    lim = dataclasses.replace(ctx.limits, max_num_tokens=ctx.limits.max_batch_size * ctx.limits.max_seq_len)
    cfg = KVCacheConfig(lim, lim.max_batch_size * -(-lim.max_seq_len // lim.page_size), ctx.dtype)
    return UncachedRunner(module, cfg, ctx.device)


__all__ = ["runner_for", "plain_step", "RunnerSource", "CacheView"]
