"""Do the runtime limits fit in memory? Checked before anything is allocated.

The limits (max_batch_size, max_seq_len, max_num_tokens, page_size) size allocations made long
after they are given: ``initialize_cache``'s first pool holds at least one max_seq_len sequence
(``[num_pages, page_size, *per-token shape]`` per cache tensor), and every cached forward's step
buffers (``SequenceInfo``) hold a page table ``[max_batch_size, max_pages_per_seq]`` int32 and ids
and positions ``[1, max_num_tokens]`` int64. Unchecked, ``max_seq_len=10**9`` surfaces as numpy's
MemoryError from inside a transform, after the pipeline ran up to it, with a hint that names the
transform rather than the argument. ``check_fits`` names the arguments, the bytes, what memory is
available and what to lower instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import psutil
import torch

from ....errors import InputError
from ....runtime.interface import KVCacheConfig, step_buffer_bytes

# how each limit is named in a message: the Workbench argument unless a transform field set it
LIMIT_NAMES = ("max_seq_len", "max_batch_size", "max_num_tokens", "page_size")


def gib(n: float) -> str:
    """Bytes for a message: "491.7 GiB", "16.0 MiB", "8.3 KiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def needed_bytes(cfg: KVCacheConfig) -> Tuple[int, int]:
    """(cache bytes, step-buffer bytes) that serving ``cfg`` allocates on its device."""
    return cfg.total_bytes(), step_buffer_bytes(cfg)


def available_memory(device: torch.device) -> Optional[Tuple[int, str]]:
    """(bytes available for new tensors on ``device``, where that figure comes from); None for a
    device whose free memory is not known (the check is skipped there)."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return free, f"free on {device} (of {gib(total)}, torch.cuda.mem_get_info)"
    if device.type == "cpu":
        vm = psutil.virtual_memory()
        return vm.available, f"available RAM (of {gib(vm.total)}, psutil)"
    return None


def limit_names(overrides: Tuple[str, ...]) -> Mapping[str, str]:
    """``{"max_seq_len": "initialize_cache.max_seq_len", ...}``: a limit a transform field set last
    (``RuntimeLimits.overrides``, "key.field: old -> new") is named by that field, the rest by
    the Workbench argument."""
    names = {n: n for n in LIMIT_NAMES}
    for note in overrides:
        field = note.split(":", 1)[0]
        names[field.rsplit(".", 1)[-1]] = field
    return names


def check_fits(
    cfg: KVCacheConfig,
    device: torch.device,
    pool_pages: Callable[[KVCacheConfig], int],
    *,
    estimated: str = "",
    model_config: Any = None,
    pages_field: str = "",
) -> None:
    """Raise ``InputError`` when the cache ``cfg`` describes plus its step buffers would not fit in
    the memory available on ``device``.

    ``pool_pages``: how many pages the allocator gives limits like ``cfg``'s (the message suggests
    the largest value of each limit that fits, found with it); ``estimated``: why the per-token
    bytes are an estimate (before the cache transforms declared the real tensors); ``model_config``:
    its max_position_embeddings is named as a sensible max_seq_len; ``pages_field``: the field that
    set the number of pages, when one did ("initialize_cache.num_pages").
    """
    have = available_memory(device)
    if have is None:
        return
    avail, where = have
    kv, buffers = needed_bytes(cfg)
    if kv + buffers <= avail:
        return
    lim, names = cfg.limits, limit_names(cfg.limits.overrides)
    given = f"{names['max_seq_len']}={lim.max_seq_len} with " + ", ".join(
        f"{names[n]}={getattr(cfg, n)}" for n in ("max_batch_size", "max_num_tokens", "page_size")
    )
    # max_num_tokens left unset follows the other two (min(2048, batch x seq)): nothing to lower
    lowerable = ["max_seq_len", "max_batch_size"] + ["max_num_tokens"] * (lim.max_num_tokens is not None)
    hints = []
    for n in lowerable:
        fit = _largest_fitting(cfg, n, pool_pages, avail)
        if fit:
            hints.append(f"{names[n]} <= {fit} fits with the others as they are")
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    max_position = getattr(text, "max_position_embeddings", None)
    if max_position:
        hints.append(f"the model's max_position_embeddings is {max_position}")
    what = [names[n] for n in lowerable] + [pages_field] * bool(pages_field)
    raise InputError(
        f"{given}{f', {pages_field}={cfg.num_pages}' if pages_field else ''} would need {gib(kv + buffers)} "
        f"on {device}: {gib(kv)} for the KV cache ({cfg.num_pages} pages of {cfg.page_size} tokens, "
        f"{cfg.bytes_per_token()} B/token{f', {estimated}' if estimated else ''}) and {gib(buffers)} for the "
        f"step buffers (a page table of {cfg.max_batch_size} x {cfg.max_pages_per_seq} pages); {gib(avail)} is "
        f"{where}. Lower {', '.join(what[:-1])} or {what[-1]} ({'; '.join(hints) or 'no one of them alone is enough'})."
    )


def _largest_fitting(
    cfg: KVCacheConfig, name: str, pool_pages: Callable[[KVCacheConfig], int], avail: int
) -> Optional[int]:
    """The largest value of limit ``name`` (the others as in ``cfg``) whose cache and buffers fit
    in ``avail`` bytes; None when not even 1 fits. Bytes grow with either limit: bisect."""

    def fits(value: int) -> bool:
        change: Dict[str, Any] = {name: value}
        limits = dataclasses.replace(cfg.limits, **change)
        sized = dataclasses.replace(cfg, limits=limits, num_pages=1)
        sized = sized.with_pages(pool_pages(sized))
        return sum(needed_bytes(sized)) <= avail

    lo, hi = 0, int(getattr(cfg.limits, name))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo or None


__all__ = ["check_fits", "available_memory", "needed_bytes", "limit_names", "gib"]
