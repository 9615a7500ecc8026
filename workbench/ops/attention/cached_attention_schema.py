"""The one schema of every cached-attention op (``torch_cached_attention``, the reference, and its
backends ``cpu_``, ``triton_`` and ``flashinfer_cached_attention``): one signature, so backends are
interchangeable in a graph (``AttentionBackend.contract_problems`` checks each op against it).

- ``CACHED_ATTENTION_ARGS``: the schema string every op is defined with.
- ``CachedAttentionArgs``: the same arguments by name, for backends that take them as they come
  (``*args, **kwargs``) rather than restating the signature; checked against the schema when an op
  is defined.
- ``cached_attention_fake``: the output every op's fake (meta) implementation returns.
- ``define_cached_attention``: registers a backend op with both.

Shapes (the metadata of one step of continuous batching; ``torch_cached_attention`` has the
semantics): q [1, T, Hq, D], k [1, T, Hkv, D], v [1, T, Hkv, Dv] with T = sum(seq_lens);
k_cache/v_cache [num_pages, page_size, Hkv, D / Dv]; seq_lens, input_pos [B] int32; page_table
[B, max_pages_per_seq] int32 -> out [1, T, Hq, Dv] in q's dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..library import check_named_args, define_op

# Registered through ``define_op`` (a ``torch.library.Library`` kernel) rather than ``custom_op``:
# for an op that mutates its inputs, custom_op adds a Python ADInplaceOrView kernel whose per-call
# argument handling (``fill_defaults`` walking the schema) costs ~50-80 us -- more than the
# attention itself in a CPU decode step, 30 times per token. The C++ fallback does the same
# version-counter bump. Every cached-attention backend op (triton, flashinfer) shares this schema
# and fake: one signature, so they are interchangeable in a graph.
CACHED_ATTENTION_ARGS = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor seq_lens, Tensor input_pos, Tensor page_table, SymInt num_prefill, float scale, "
    "SymInt? sliding_window=None, float? logit_cap=None, Tensor? sinks=None, Tensor? alibi_slopes=None, "
    "SymInt? chunk_size=None) -> Tensor"
)


class CachedAttentionArgs(NamedTuple):
    """The arguments of a cached-attention op, by name, in the schema's order. The dispatcher hands
    a kernel all of them positionally; a direct call may name them (``CachedAttentionArgs(*args,
    **kwargs)`` takes both)."""

    q: torch.Tensor  # [1, T, Hq, D]: the step's new tokens, sequence after sequence
    k: torch.Tensor  # [1, T, Hkv, D]
    v: torch.Tensor  # [1, T, Hkv, Dv]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]; the new rows are written into it
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, Dv]; likewise
    seq_lens: torch.Tensor  # [B] int32: new tokens of each sequence
    input_pos: torch.Tensor  # [B] int32: tokens of each sequence already cached
    page_table: torch.Tensor  # [B, max_pages_per_seq] int32: page ids, in logical order
    num_prefill: int  # sequences 0..num_prefill-1 prefill (any length), the rest decode (1 token)
    scale: float  # of the logits
    sliding_window: Optional[int] = None  # attend to the last ``sliding_window`` positions only
    logit_cap: Optional[float] = None  # logit_cap * tanh(logits / logit_cap)
    sinks: Optional[torch.Tensor] = None  # [Hq]: one extra logit per head in the softmax denominator
    alibi_slopes: Optional[torch.Tensor] = None  # [Hq]: slopes[h] * (k_pos - q_pos) added to the logits
    chunk_size: Optional[int] = None  # chunked local attention: keys of the query's own chunk only


def cached_attention_fake(q, k, v, *_metadata, **_options):
    """Output of every cached-attention op: q's shape with v's head dim [1, T, Hq, Dv]."""
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def define_cached_attention(name: str, impl: Callable, host_sync: Optional[str] = None):
    """Register ``workbench::<name>`` with the shared cached-attention schema and fake (``host_sync``:
    why it cannot be captured in a CUDA graph, if it cannot)."""
    op = define_op(name + CACHED_ATTENTION_ARGS, impl, cached_attention_fake, host_sync=host_sync, category="attention")
    check_named_args(op, CachedAttentionArgs)
    return op


__all__ = ["CACHED_ATTENTION_ARGS", "CachedAttentionArgs", "cached_attention_fake", "define_cached_attention"]
