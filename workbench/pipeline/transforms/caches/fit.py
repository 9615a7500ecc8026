"""The runtime limits against memory at ``Workbench`` construction, before the pipeline runs.

``initialize_cache`` checks its pool with the cache tensors the insert transforms declared; that is
after export and matching (seconds to minutes). The same check runs at construction with the K/V
bytes per token estimated from the model config, so ``Workbench(..., max_seq_len=10**9)`` fails
at once. The estimate is a lower bound of what the cache stage declares -- only layers the config
marks as attention (``layer_types``), K and V of ``num_key_value_heads x head_dim`` each (MLA: one
compressed ``kv_lora_rank + qk_rope_head_dim`` vector), KV heads split over the ranks of a sharded
run -- so a model family it does not know is under-counted, never refused wrongly.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ....models.dtypes import resolve_dtype
from ....runtime.interface import PAGED, CacheSpec, KVCacheConfig, RuntimeLimits
from ...config import PipelineEntry
from .alloc import InitializeCacheConfig, pool_pages
from .memory import check_fits

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def kv_elems_per_token(config: Any, world_size: int = 1) -> int:
    """K/V elements one token costs across all attention layers (a lower bound; 0: unknown)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return 0
    types = getattr(config, "layer_types", None)
    if types:
        layers = sum(1 for t in types if t in ATTENTION_LAYER_TYPES)
    if getattr(config, "kv_lora_rank", None):  # MLA caches the compressed latent and the rope key
        return layers * (int(config.kv_lora_rank) + int(getattr(config, "qk_rope_head_dim", 0) or 0))
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else 0)
    kv_heads = max(1, int(getattr(config, "num_key_value_heads", None) or heads) // max(1, world_size))
    return layers * kv_heads * int(head_dim) * 2


def check_limits_early(
    entries: Sequence[PipelineEntry],
    limits: RuntimeLimits,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int = 1,
) -> None:
    """Raise ``InputError`` when the pool ``initialize_cache`` will allocate for ``limits`` (with
    the limits its and ``export_to_gm``'s fields override) and the step buffers cannot fit."""
    configs = {e.key: e.config for e in entries if e.config.enabled}
    init = configs.get("initialize_cache")
    if not isinstance(init, InitializeCacheConfig):
        return  # no cache stage: nothing is allocated for the limits
    export = configs.get("export_to_gm")  # its bounds override the limits too (read by name: another family)
    if export is not None:
        bounds = {k: getattr(export, k, None) for k in ("max_batch_size", "max_seq_len")}
        limits = limits.override("export_to_gm", **bounds)
    limits = limits.override(
        "initialize_cache",
        max_batch_size=init.max_batch_size,
        max_seq_len=init.max_seq_len,
        max_num_tokens=init.max_num_tokens,
        page_size=init.page_size,
    )
    elems = kv_elems_per_token(config, world_size)
    specs = (CacheSpec("kv (estimated from the model config)", PAGED, (elems,)),) if elems else ()
    cfg = KVCacheConfig(limits, 1, resolve_dtype(init.dtype) if init.dtype else dtype, specs)
    pages = functools.partial(pool_pages, num_pages=init.num_pages)
    check_fits(
        cfg.with_pages(pages(cfg)),
        device,
        pages,
        estimated="estimated from the model config" if elems else "",
        model_config=config,
        pages_field="initialize_cache.num_pages" if init.num_pages else "",
    )


__all__ = ["check_limits_early", "kv_elems_per_token"]
