"""``workbench::flashinfer_cached_attention``: the cached attention op on FlashInfer's paged kernels.

Same signature and semantics as ``torch_cached_attention`` (see that module for shapes). GPU only
and an optional extra (``pip install flashinfer-python``): the op is always registered, so graphs
that use it stay loadable and printable everywhere; ``is_available()`` says whether it can run
here and, if not, what is missing; ``unsupported()`` which layer shapes it cannot take (head dims
other than 64/128/256, fp32, sinks). ``insert_cached_attention(backend="flashinfer")`` asks both
before it rewrites anything.

Mapping to FlashInfer (NHD layout, separate K and V page pools, exactly our cache layout):

* ``append_paged_kv_cache`` writes the step's k/v at ``input_pos .. input_pos + seq_lens - 1``;
* ``BatchPrefillWithPagedKVCacheWrapper`` handles every sequence of the step (decode is the
  ``qo_len == 1`` case), causal with bottom-right alignment as in our reference;
* ``sliding_window = w`` keeps ``q - k < w``, FlashInfer's ``window_left = w - 1``;
* ``logit_cap`` is FlashInfer's ``logits_soft_cap``. Attention sinks are not supported here.

The plan is rebuilt on every call (per layer): simple and correct; sharing one plan across the
layers of a step is the obvious optimisation once this backend is measured on a GPU.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..flashinfer_support import flashinfer_attention_unsupported
from ..flashinfer_support import flashinfer_available as is_available  # noqa: F401  (public per-op name)
from .torch_cached_attention import define_cached_attention

_WORKSPACE_BYTES = 128 * 2**20


def unsupported(head_dim: int, v_head_dim: int, dtype: torch.dtype, has_sinks: bool = False) -> Optional[str]:
    """Why this backend cannot serve a layer of this shape (None: it can); asked by
    ``insert_cached_attention`` for every layer before it rewrites anything."""
    return flashinfer_attention_unsupported(head_dim, v_head_dim, dtype, has_sinks)


class _Workspaces:
    """FlashInfer's scratch buffer, one per device, allocated on first use and then reused.

    An explicit object owned by this module rather than a bare dict so the one piece of state
    this backend keeps is named and documented; it only caches an allocation.
    """

    def __init__(self) -> None:
        self._buffers: Dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._buffers:
            self._buffers[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._buffers[device]


WORKSPACES = _Workspaces()


def paged_kv_indices(seq_lens, input_pos, page_table, page_size: int):
    """FlashInfer's CSR page description: (kv_indptr [B+1], kv_indices [nnz], last_page_len [B],
    kv_lens [B]), all int32 on the metadata's device."""
    kv_lens = (input_pos + seq_lens).int()
    n_pages = (kv_lens + page_size - 1) // page_size  # [B]
    kv_indptr = torch.zeros(kv_lens.numel() + 1, dtype=torch.int32, device=kv_lens.device)
    kv_indptr[1:] = torch.cumsum(n_pages, 0)
    cols = torch.arange(page_table.shape[1], device=kv_lens.device)
    used = cols[None, :] < n_pages[:, None]  # [B, max_pages]
    kv_indices = page_table[: kv_lens.numel()][used].int()
    last_page_len = ((kv_lens - 1) % page_size + 1).int()
    return kv_indptr, kv_indices, last_page_len, kv_lens


def flashinfer_cached_attention(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill, scale,
                                sliding_window=None, logit_cap=None, sinks=None) -> torch.Tensor:
    """FlashInfer paged attention under the shared cached-attention schema (``torch_cached_attention``)."""
    ok, why = is_available(q.device)
    if not ok:
        raise RuntimeError(f"flashinfer_cached_attention cannot run: {why}")
    if sinks is not None:
        raise NotImplementedError("flashinfer_cached_attention: attention sinks are not supported; use backend torch or triton")
    import flashinfer

    page_size = k_cache.shape[1]
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    t = q.shape[1]
    kv_indptr, kv_indices, last_page_len, kv_lens = paged_kv_indices(seq_lens, input_pos, page_table, page_size)
    qo_indptr = torch.zeros_like(kv_indptr)
    qo_indptr[1:] = torch.cumsum(seq_lens.int(), 0)
    batch_indices, positions = flashinfer.get_batch_indices_positions(qo_indptr, kv_lens, t)
    flashinfer.append_paged_kv_cache(
        k[0], v[0], batch_indices, positions, (k_cache, v_cache), kv_indices, kv_indptr,
        last_page_len, kv_layout="NHD",
    )
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(WORKSPACES.get(q.device), "NHD")
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, causal=True,
        sm_scale=scale, window_left=-1 if sliding_window is None else sliding_window - 1,
        logits_soft_cap=logit_cap or 0.0, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )
    out = wrapper.run(q[0], (k_cache, v_cache))  # [T, Hq, Dv]
    return out.to(q.dtype).unsqueeze(0)


define_cached_attention("flashinfer_cached_attention", flashinfer_cached_attention)
