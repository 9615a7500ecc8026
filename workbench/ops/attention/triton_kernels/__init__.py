"""Triton kernels behind ``workbench::triton_cached_attention`` (paged KV cache).

Modules here import triton at the top, so only the launcher imports them, lazily, on the first
call: importing ``workbench.ops`` never needs triton, and ``triton.jit`` reads ``TRITON_INTERPRET``
when a kernel is decorated, so the env var set before the first call decides compiled vs
interpreted for the whole process.

- ``paged_common``: jitted helpers (logical position -> cache row offset, query/output rows, the
  online-softmax step, soft-cap, ALiBi).
- ``paged_kv_append``: writes the step's new K/V rows into their pages (one launch; also used by
  the FlashInfer op, and by ``triton_cached_mla`` for its latent cache).
- ``paged_prefill``: flash-attention over query tiles of one sequence and its pages (causal).
- ``paged_decode``: one query token per sequence, the GQA group per program, optional split-K
  plus the kernel that merges the splits.
"""
