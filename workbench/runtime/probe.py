"""One-off forwards of a cached module outside ``generate``: the numerics probe and the measurement
forward of ``resize_kv_cache``.

* ``CachedProbe`` keeps the per-transform numerics probe working after cache insertion: it runs
  the probe batch ``[b, s]`` as b prefill sequences through the cached module on scratch caches of
  its own, sized for exactly that, so the probe never touches (or needs) the real caches.
* ``prefill_forward`` runs one prefill of n random tokens on the real caches (``resize_kv_cache``
  measures activation memory with it).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .kv_cache import CacheSpec, KVCacheConfig, allocate_caches
from .sequence_info import LAST_TOKEN_INPUT, SequenceInfo, module_input_names


def run_cached(module: torch.nn.Module, values: Mapping[str, Any]) -> Any:
    """Call a cached module with its inputs looked up by name."""
    names = module_input_names(module)
    missing = [n for n in names if n not in values]
    if missing:
        raise KeyError(f"no value for the module inputs {missing} (have {sorted(values)})")
    return module(*[values[n] for n in names])


class CachedProbe:
    """``(module, probe_batch) -> logits [b, s, V]`` for a cached module.

    The probe's b rows become b prefill sequences of s tokens on scratch caches. Graph modules get
    ``input_ids [b, s]`` as is: the cached attention flattens ``[b, s, ...]`` to ``[1, b*s, ...]``
    itself, so the logits come back in the probe's shape.
    """

    def __init__(self, specs: Sequence[CacheSpec], dtype: torch.dtype, page_size: int = 16):
        self.specs, self.dtype, self.page_size = tuple(specs), dtype, page_size

    def __call__(self, module: torch.nn.Module, probe) -> torch.Tensor:
        ids, pos = probe.input_ids, probe.position_ids
        b, s = ids.shape
        per_seq = -(-s // self.page_size)
        cfg = KVCacheConfig.sized(
            page_size=self.page_size,
            num_pages=b * per_seq,
            dtype=self.dtype,
            max_batch_size=b,
            max_seq_len=s,
            max_num_tokens=b * s,
            specs=self.specs,
        )
        info = SequenceInfo.from_config(cfg, ids.device)
        pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        info.set_batch(ids.tolist(), [0] * b, pages, num_prefill=b, page_size=self.page_size)
        values = {**info.inputs(), **allocate_caches(cfg, ids.device)}
        values.update(input_ids=ids, position_ids=pos)  # [b, s]: logits come back as [b, s, V]
        if LAST_TOKEN_INPUT not in module_input_names(module):
            return run_cached(module, values)
        # a graph that gathers before the LM head gets every token's index: all b*s rows come back
        values[LAST_TOKEN_INPUT] = torch.arange(b * s, device=ids.device)
        return run_cached(module, values).reshape(b, s, -1)

    def __repr__(self) -> str:
        return f"CachedProbe({len(self.specs)} cache inputs, scratch pages of {self.page_size})"


def prefill_forward(
    module: torch.nn.Module,
    caches: Mapping[str, torch.Tensor],
    cfg: KVCacheConfig,
    num_tokens: int,
    vocab_size: int,
    device: torch.device,
) -> int:
    """One prefill of ``num_tokens`` seeded random tokens through the cached module on ``caches``
    (clamped to what one step and one sequence can hold). Returns the tokens it ran."""
    n = max(1, min(num_tokens, cfg.max_num_tokens, cfg.max_seq_len, cfg.token_capacity))
    info = SequenceInfo.from_config(cfg, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
    info.set_batch([ids], [0], [list(range(cfg.pages_for(n)))], num_prefill=1, page_size=cfg.page_size)
    with torch.no_grad():
        run_cached(module, {**info.inputs(), **caches})
    return n


__all__ = ["CachedProbe", "run_cached", "prefill_forward"]
