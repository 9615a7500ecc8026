"""``initialize_cache`` and ``resize_kv_cache`` (stage ``cache_init``): allocate the paged KV cache.

Two phases, because how much memory the cache may take is only known once the model has run:

1. ``initialize_cache`` reads the ``CacheSpec``s the insert transforms declared
   (``ctx.cache.specs``) and allocates them with a conservative number of pages -- enough
   for one max-length sequence and one full step of ``max_num_tokens`` -- so a forward can run.
   Limits that could not fit in memory are refused before allocating (``memory.py``; ``fit.py``
   runs the same check with estimated K/V bytes when the ``Workbench`` is built).
2. ``resize_kv_cache`` runs one forward on those caches to measure activation memory, then
   re-allocates the pool at its working size: on a GPU ``free_mem_ratio`` of the memory left once
   weights and the activation peak are accounted for; on CPU, where "free memory" is meaningless
   (the OS hands out pages lazily, other processes share the RAM), a configured byte budget -- so
   no forward there unless ``forward_num_tokens`` asks for one.
   Never more pages than ``max_batch_size`` sequences of ``max_seq_len`` can use.

The cache tensors go into ``ctx.cache.tensors`` (the stepper reports their bytes as each snapshot's
memory delta, hence ``expect_mem_change``); the geometry into ``ctx.cache.config`` for the runtime.
The limits (max_batch_size, max_seq_len, max_num_tokens, page_size) come from ``ctx.limits``; a
field set here overrides one of them for the rest of the pipeline, and the override is reported.
Neither transform changes the graph.
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, Optional, Tuple

import psutil
import torch
from pydantic import Field, field_validator

from ....models.dtypes import resolve_dtype
from ....runtime.interface import KVCacheConfig, allocate_caches, prefill_forward
from ...context import CACHE_SPECS, KV_CACHE, PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from .attention import uncached_attention
from .memory import check_fits
from .state_rewrite import uncached_state_ops

logger = logging.getLogger("workbench.pipeline")

DEFAULT_CPU_BUDGET = 256 * 2**20


class InitializeCacheConfig(TransformConfig):
    expect_mem_change: bool = Field(default=True, description="Allocating the caches changes memory: this is expected.")
    page_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tokens per KV-cache page; None: the pipeline's page_size (16 unless Workbench(page_size=...)).",
    )
    dtype: Optional[str] = Field(
        default=None, description="KV-cache dtype (float32, bfloat16, float16); None: the model's dtype."
    )
    max_batch_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Sequences in flight at once; None: the pipeline's max_batch_size (set "
        "here, it overrides it for the rest of the pipeline and the runtime; so do the fields below).",
    )
    max_seq_len: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tokens one sequence may hold (prompt + generated); None: the pipeline's max_seq_len.",
    )
    max_num_tokens: Optional[int] = Field(
        default=None,
        ge=1,
        description="Flattened tokens per forward step (longer prompts are prefilled "
        "in chunks); None: the pipeline's, by default min(2048, max_batch_size * max_seq_len).",
    )
    num_pages: Optional[int] = Field(
        default=None,
        ge=1,
        description="Pages to allocate; None: conservative (one max-length sequence and one full step).",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            resolve_dtype(v)
        return v


def conservative_pages(cfg: KVCacheConfig) -> int:
    """Enough for one max-length sequence, and for one step of ``max_num_tokens`` spread over
    ``max_batch_size`` sequences (each may end in a partly filled page)."""
    one_step = cfg.pages_for(cfg.max_num_tokens) + cfg.max_batch_size - 1
    return min(max(cfg.max_pages_per_seq, one_step), cfg.pages_to_fill())


def pool_pages(cfg: KVCacheConfig, num_pages: Optional[int] = None) -> int:
    """The pages ``initialize_cache`` allocates: its ``num_pages`` field, else conservative ones (a
    model without paged caches, pure SSM, pays nothing per page: it gets every page its limits use)."""
    if num_pages:
        return num_pages
    return conservative_pages(cfg) if cfg.bytes_per_page() else cfg.pages_to_fill()


def _no_specs(key: str) -> TransformInfo:
    return TransformInfo(
        num_matches=0,
        skip_reason=f"{key}: no cache inputs declared (insert_cached_attention or "
        "transformers_replace_cached_attn did not run)",
    )


def _refuse_uncached_state(mod) -> None:
    """A cached graph feeds each step's new tokens only: a recurrent op left uncached would restart
    from nothing every step, an attention left uncached would attend to the new tokens only (wrong
    tokens, not just slow). Refuse, naming the transform to enable."""
    if not isinstance(mod, torch.fx.GraphModule):
        return
    attention = uncached_attention(mod)
    if attention:
        shown = "; ".join(f"{k}: {v}" for k, v in list(attention.items())[:2])
        raise ValueError(
            f"{len(attention)} attention node(s) have no KV cache while the graph is otherwise cached ({shown}"
            f"{' ...' if len(attention) > 2 else ''}). Each step would let them attend to the new tokens only. "
            "Enable insert_cached_attention (or disable the whole cache_init stage to run uncached)."
        )
    left = uncached_state_ops(mod)
    if left:
        keys = sorted(set(left.values()))
        raise ValueError(
            f"{len(left)} recurrent node(s) have no state cache while the graph is otherwise cached: "
            f"{', '.join(list(left)[:4])}{' ...' if len(left) > 4 else ''}. Each step would feed them only the new "
            f"tokens, without the state of earlier ones. Enable {', '.join(keys)} (or disable the whole cache_init "
            "stage to run uncached)."
        )


@register("initialize_cache")
class InitializeCache(Transform[InitializeCacheConfig]):
    """Allocate every declared cache with conservative capacity."""

    needs = (CACHE_SPECS,)
    provides = (KV_CACHE,)

    def _apply(self, mod: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not ctx.cache.specs:
            return mod, _no_specs(self.key)
        _refuse_uncached_state(mod)
        c = self.config
        ctx.limits = ctx.limits.override(
            self.key,
            max_batch_size=c.max_batch_size,
            max_seq_len=c.max_seq_len,
            max_num_tokens=c.max_num_tokens,
            page_size=c.page_size,
        )
        lim = ctx.limits
        cfg = KVCacheConfig(lim, 1, resolve_dtype(c.dtype) if c.dtype else ctx.dtype, tuple(ctx.cache.specs))
        pages = functools.partial(pool_pages, num_pages=c.num_pages)
        cfg = cfg.with_pages(pages(cfg))
        # before allocating: a limit too large fails naming it, not as numpy's MemoryError
        check_fits(
            cfg,
            ctx.device,
            pages,
            model_config=ctx.config if ctx.loaded is not None else None,
            pages_field=f"{self.key}.num_pages" if c.num_pages else "",
        )
        caches = allocate_caches(cfg, ctx.device)
        ctx.cache.tensors = {**ctx.cache.tensors, **caches}
        ctx.cache.config = cfg
        details = {**cfg.summary(), "allocated": len(caches)}
        if lim.overrides:
            details["limit_overrides"] = list(lim.overrides)
        return mod, TransformInfo(num_matches=0, details=details)


class ResizeKVCacheConfig(TransformConfig):
    expect_mem_change: bool = Field(
        default=True, description="Re-allocating the caches changes memory: this is expected."
    )
    free_mem_ratio: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="On a GPU: fraction of the memory left after weights and the measured activation "
        "peak that the KV cache may take.",
    )
    cpu_budget_bytes: int = Field(
        default=DEFAULT_CPU_BUDGET,
        ge=1,
        description="On CPU: bytes the KV cache may take (CPU has no reliable free-memory figure).",
    )
    forward_num_tokens: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tokens of the measurement forward; None: max_num_tokens on a GPU (the activation "
        "peak of a full step), and no forward on CPU, whose budget is cpu_budget_bytes (set, the CPU "
        "forward runs to check the cached graph and report its RSS growth).",
    )


def _release(tensors) -> None:
    """Free the storage of superseded CUDA caches so the new pool can use that memory.

    The ``initialize_cache`` snapshot still references them; its tensors become empty, which is
    harmless: resuming from there re-runs ``resize_kv_cache``, which never reads the old caches.
    """
    for t in tensors:
        t.untyped_storage().resize_(0)


@register("resize_kv_cache")
class ResizeKVCache(Transform[ResizeKVCacheConfig]):
    """Measure activation memory with one forward, then grow the KV cache to its working size."""

    needs = (KV_CACHE,)

    def _apply(self, mod: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        cfg: Optional[KVCacheConfig] = ctx.cache.config
        if cfg is None:
            if ctx.cache.specs:  # specs declared but never allocated: initialize_cache is off
                ctx.cache.require_config(self.key)
            return mod, _no_specs(self.key)
        c = self.config
        cuda = ctx.device.type == "cuda" and torch.cuda.is_available()
        old_bytes = cfg.num_pages * cfg.bytes_per_page()
        details: Dict[str, object] = {"old_num_pages": cfg.num_pages}
        if cuda:
            tokens = c.forward_num_tokens or cfg.max_num_tokens
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
            prefill_forward(mod, ctx.cache.tensors, cfg, tokens, ctx.vocab_size, ctx.device)
            torch.cuda.synchronize(ctx.device)
            activation = torch.cuda.max_memory_allocated(ctx.device) - base
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info(ctx.device)
            # The old pool is released below, so its bytes count as available.
            budget = int(c.free_mem_ratio * max(0, free + old_bytes - activation))
            details.update(activation_bytes=activation, free_bytes=free, budget_bytes=budget)
        else:
            # No activation figure feeds the CPU budget, and the numerics probe runs the cached graph
            # already: the forward (~0.2 s and ~20 MB of peak RSS on smollm2) only when asked for.
            tokens = c.forward_num_tokens or 0
            if tokens:
                rss = psutil.Process().memory_info().rss
                prefill_forward(mod, ctx.cache.tensors, cfg, tokens, ctx.vocab_size, ctx.device)
                details.update(rss_growth_bytes=psutil.Process().memory_info().rss - rss)
            details.update(budget_bytes=c.cpu_budget_bytes)
            budget = c.cpu_budget_bytes
        budget -= cfg.fixed_bytes()
        # a model without paged caches (pure SSM) pays nothing per page: its "pages" only count tokens
        pages = (
            min(budget // cfg.bytes_per_page(), cfg.pages_to_fill()) if cfg.bytes_per_page() else cfg.pages_to_fill()
        )
        if pages < cfg.max_pages_per_seq:
            logger.warning(
                "[stage=%s, transform=%s] the KV-cache budget holds %d pages (%d tokens), less than one "
                "max_seq_len=%d sequence; long prompts will be refused",
                self.config.stage.value,
                self.key,
                max(pages, 1),
                max(pages, 1) * cfg.page_size,
                cfg.max_seq_len,
            )
        new_cfg = cfg.with_pages(max(int(pages), 1))
        tensors = ctx.cache.tensors
        old = [tensors[s.name] for s in cfg.specs if s.name in tensors]
        tensors = {k: v for k, v in tensors.items() if k not in {s.name for s in cfg.specs}}
        if cuda:
            _release(old)
        ctx.cache.tensors = {**tensors, **allocate_caches(new_cfg, ctx.device)}
        ctx.cache.config = new_cfg
        details.update(new_cfg.summary(), forward_tokens=tokens)
        return mod, TransformInfo(num_matches=0, details=details)


__all__ = ["InitializeCache", "ResizeKVCache", "conservative_pages", "pool_pages"]
