"""A CPU stand-in for the part of flashinfer-python 0.6.18.post1 the workbench calls, in plain torch.

It keeps that version's signatures and the rules its code enforces (read from its source:
``prefill.py`` BatchPrefillWithPagedKVCacheWrapper ``__init__``/``plan``/``run``), so a CPU test
catches a call the real library would refuse or misread:

* ``plan()``: int32 index tensors; ``q_data_type`` defaults to float16 and must match ``run``'s q;
  head dims 64/128/256 and fp16/bf16 only (the JIT module tables have no fp32); in CUDA-graph
  mode (``use_cuda_graph=True``) the four index buffers are required, the batch size is frozen to
  theirs and the step's rows may not exceed the first plan's; the indices are copied *into* the
  fixed buffers. ``plan_calls_from_device`` counts plans fed device tensors (a host sync on a GPU).
* ``run()``: q rows must equal the plan's ``qo_indptr[-1]``; ``window_left`` fixed by the plan;
  reads the page indices from the wrapper's buffers at run time (graph mode), as the captured
  FA2 kernel does, so a replay after a re-plan sees the new pages.

The attention itself is the causal, bottom-right-aligned, windowed, soft-capped softmax the real
kernels compute, in fp32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__version__ = "0.6.18.post1 (CPU test stand-in)"
HEAD_DIMS = (64, 128, 256)
HALF = (torch.float16, torch.bfloat16)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(x):
    return _DTYPES[x] if isinstance(x, str) else x


class BatchPrefillWithPagedKVCacheWrapper:
    plan_calls_from_device = 0

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[torch.Tensor] = None, paged_kv_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indices_buf: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buf: Optional[torch.Tensor] = None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        if kv_layout not in ("NHD", "HND"):
            raise KeyError(f"Invalid kv_layout {kv_layout}")
        if backend not in ("auto", "fa2", "fa3", "cudnn", "trtllm-gen"):
            raise ValueError(f"unknown backend {backend}")
        self.use_cuda_graph = use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        if use_cuda_graph:
            if any(b is None for b in self.bufs):
                raise ValueError("use_cuda_graph=True needs qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf "
                                 "and paged_kv_last_page_len_buf")
            if any(b.dtype != torch.int32 for b in self.bufs):
                raise ValueError("the CUDA-graph index buffers must be int32")
            self.fixed_batch_size = len(qo_indptr_buf) - 1
            if len(paged_kv_indptr_buf) != self.fixed_batch_size + 1 or len(paged_kv_last_page_len_buf) != self.fixed_batch_size:
                raise ValueError("index buffers of different batch sizes")
        self.max_total_rows: Optional[int] = None
        self.planned = None

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: Optional[int] = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, **rest) -> None:
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            if t.dtype != torch.int32:
                raise ValueError(f"index tensors must be int32, got {t.dtype}")
        if any(t.device.type != "cpu" for t in (qo_indptr, paged_kv_indptr, paged_kv_last_page_len)):
            type(self).plan_calls_from_device += 1  # .to("cpu") of a device tensor: a sync on a GPU
        q_dtype, kv_dtype = _dtype(q_data_type), _dtype(kv_data_type or q_data_type)
        if q_dtype not in HALF or kv_dtype not in HALF:
            raise KeyError(f"no FlashInfer module for q {q_dtype} / kv {kv_dtype}")
        if head_dim_qk not in HEAD_DIMS or (head_dim_vo or head_dim_qk) != head_dim_qk:
            raise ValueError(f"no FlashInfer kernel for head dims {head_dim_qk}/{head_dim_vo}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        batch, rows = len(qo_indptr) - 1, int(qo_indptr[-1])
        host = tuple(t.cpu() for t in (qo_indptr, paged_kv_indptr, paged_kv_last_page_len))
        if self.use_cuda_graph:
            if batch != self.fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                                 f" mismatches the batch size set during initialization {self.fixed_batch_size}")
            if self.max_total_rows is not None and rows > self.max_total_rows:
                raise ValueError("the number of rows exceeds the first plan's in cudagraph mode")
            if len(paged_kv_indices) > len(self.bufs[2]):
                raise ValueError("paged_kv_indices exceed paged_kv_indices_buf")
            self.bufs[0].copy_(qo_indptr)
            self.bufs[1].copy_(paged_kv_indptr)
            self.bufs[2][: len(paged_kv_indices)].copy_(paged_kv_indices)
            self.bufs[3].copy_(paged_kv_last_page_len)
            indices = self.bufs[2]  # read at run time, as the captured kernels do
        else:
            indices = paged_kv_indices.clone()
        self.max_total_rows = self.max_total_rows or rows
        self.planned = dict(host=host, indices=indices, hq=num_qo_heads, hkv=num_kv_heads, d=head_dim_qk,
                            page_size=page_size, causal=causal, scale=sm_scale or head_dim_qk ** -0.5,
                            window_left=window_left, cap=logits_soft_cap, q_dtype=q_dtype, kv_dtype=kv_dtype)

    def run(self, q: torch.Tensor, paged_kv_cache: Tuple[torch.Tensor, torch.Tensor], *args,
            out: Optional[torch.Tensor] = None, window_left: Optional[int] = None, **rest) -> torch.Tensor:
        p = self.planned
        if p is None:
            raise RuntimeError("run() before plan()")
        if q.dtype != p["q_dtype"]:
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {p['q_dtype']} specified in plan")
        k_cache, v_cache = paged_kv_cache
        if k_cache.dtype != p["kv_dtype"] or k_cache.stride() != v_cache.stride():
            raise ValueError("kv cache dtype differs from the plan, or K and V strides differ")
        if window_left is not None and window_left != p["window_left"]:
            raise AssertionError("window_left must equal the planned value")
        qo_indptr, kv_indptr, last = (t.tolist() for t in p["host"])
        if q.shape[0] != qo_indptr[-1] or q.shape[1:] != (p["hq"], p["d"]):
            raise ValueError(f"q {tuple(q.shape)} does not match the plan ({qo_indptr[-1]} rows, {p['hq']} heads)")
        indices = p["indices"].tolist()
        result = torch.zeros(q.shape, dtype=q.dtype)
        rep, ps = p["hq"] // p["hkv"], p["page_size"]
        for i in range(len(qo_indptr) - 1):
            pages = indices[kv_indptr[i]: kv_indptr[i + 1]]
            kv_len = (len(pages) - 1) * ps + last[i]
            k = k_cache[pages].reshape(-1, p["hkv"], p["d"])[:kv_len].float().repeat_interleave(rep, dim=1)
            v = v_cache[pages].reshape(-1, p["hkv"], p["d"])[:kv_len].float().repeat_interleave(rep, dim=1)
            qi = q[qo_indptr[i]: qo_indptr[i + 1]].float()  # [n, Hq, D]
            n = qi.shape[0]
            scores = torch.einsum("nhd,khd->hnk", qi, k) * p["scale"]
            if p["cap"]:
                scores = p["cap"] * torch.tanh(scores / p["cap"])
            q_pos = torch.arange(kv_len - n, kv_len)[:, None]
            k_pos = torch.arange(kv_len)[None, :]
            keep = (k_pos <= q_pos) if p["causal"] else torch.ones(n, kv_len, dtype=torch.bool)
            if p["window_left"] >= 0:
                keep &= k_pos >= q_pos - p["window_left"]
            probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            result[qo_indptr[i]: qo_indptr[i + 1]] = torch.einsum("hnk,khd->nhd", probs, v).to(q.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result


class norm:  # noqa: N801 - stands in for the flashinfer.norm module
    @staticmethod
    def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None, enable_pdl=None):
        if input.dim() not in (2, 3) or input.dtype not in HALF:
            raise ValueError("rmsnorm takes 2-D/3-D float16/bfloat16 input on the CUDA path")
        x = input.float()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
        return y if out is None else out.copy_(y)
