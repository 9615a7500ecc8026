"""``workbench::flashinfer_cached_attention``: the cached attention op on FlashInfer's paged kernels.

Same signature and semantics as ``torch_cached_attention`` (see that module for shapes). GPU only
and an optional extra (``pip install flashinfer-python``; written against 0.6.18.post1): the op is
always registered, so graphs that use it stay loadable and printable everywhere; ``is_available()``
says whether it can run here and, if not, what is missing; ``unsupported()`` which layer shapes it
cannot take (head dims other than 64/128/256, K/V head dims that differ, fp32, sinks, ALiBi slopes).
``insert_cached_attention`` asks both before it rewrites anything, and the op itself refuses such a
call up front, naming the backends that can serve it.

One call, per layer:

* the step's new k/v are written into the page pools by one Triton launch that finds each row's
  sequence on the device (``append_paged_kv``: no host read, no per-step index tensors; the tensor-op
  ``write_kv`` where Triton is missing);
* attention runs through ``BatchPrefillWithPagedKVCacheWrapper`` (backend ``fa2``: one kernel
  family for prefill, decode and mixed steps, any GQA group; decode is the ``qo_len == 1`` case),
  NHD layout with separate K and V pools -- exactly our cache layout -- causal, bottom-right
  aligned as in our reference; ``sliding_window = w`` is FlashInfer's ``window_left = w - 1``,
  ``logit_cap`` its ``logits_soft_cap``.

FlashInfer's ``plan()`` computes the kernels' work partition on the host from the step's lengths
and pages; it cannot run under CUDA-graph capture, and a replay never calls the op. So plans live
in a ``FlashInferPlanner`` that the runtime owns and drives (``workbench.ops.step_plan``): it plans
once per step -- shared by every layer with the same (heads, head dim, window, cap, scale, dtypes) --
from the host's own copy of the step layout, with one wrapper per captured decode batch size in
CUDA-graph mode (fixed-address index buffers, re-planned before each replay). Called outside a
runner (numerics probe, tests) the op plans from its metadata tensors itself: a device -> host read,
refused under capture with a message saying how to capture it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple, cast

import torch

from ..flashinfer_support import FLASHINFER_DTYPES, flashinfer_attention_unsupported
from ..flashinfer_support import flashinfer_available as is_available  # noqa: F401  (public per-op name)
from ..step_plan import HostStep, active_planner
from ..triton_support import HAS_TRITON
from .cached_attention_schema import CachedAttentionArgs, define_cached_attention
from .torch_cached_attention import token_layout, write_kv

_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV scratch)
_KERNELS = "fa2"  # FlashInfer's FA2 kernels: sm80+, one JIT family for every step kind
OTHER_BACKENDS = "'triton' or 'torch'"
# FlashInfer's ALiBi mode derives its own slopes from the head count (the BLOOM formula); MPT's and
# Falcon's differ, and the graph's slopes cannot be passed to its paged wrappers.
ALIBI_UNSUPPORTED = "ALiBi slopes (not supported by this backend)"
# Chunked local attention (Llama 4's attention_chunk_size): FlashInfer's paged wrappers take a causal
# mask and a left window, no chunk boundaries; refused by name when the backend is chosen
# (``AttentionBackend.unsupported_chunked``) and when the op is called.
CHUNKED_UNSUPPORTED = "chunked local attention (chunk_size: FlashInfer's paged kernels have no chunk mask)"


def unsupported(head_dim: int, v_head_dim: int, dtype: torch.dtype, has_sinks: bool = False) -> Optional[str]:
    """Why this backend cannot serve a layer of this shape (None: it can); asked by
    ``insert_cached_attention`` for every layer before it rewrites anything."""
    return flashinfer_attention_unsupported(head_dim, v_head_dim, dtype, has_sinks)


@dataclass(frozen=True)
class PlanKey:
    """What one FlashInfer plan serves: every layer with these values shares it in a step. The
    fields are ``BatchPrefillWithPagedKVCacheWrapper.plan()``'s keyword arguments of those names
    (``plan_arguments``)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    page_size: int
    window_left: int  # -1: no window
    logits_soft_cap: Optional[float]
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype

    def plan_arguments(self) -> Dict[str, Any]:
        """``plan()``'s keyword arguments for this key."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def host_indices(step: HostStep) -> Tuple[torch.Tensor, ...]:
    """FlashInfer's CSR description of ``step`` on the host, all int32: (qo_indptr [B+1],
    kv_indptr [B+1], kv_indices [pages in use], last_page_len [B]). Sequence i's keys are its
    ``input_pos + seq_len`` cached tokens, on its first ``ceil(kv_len / page_size)`` pages."""
    ps = step.page_size
    kv_lens = [p + n for p, n in zip(step.input_pos, step.seq_lens)]
    used = [-(-n // ps) for n in kv_lens]
    qo_indptr, kv_indptr = [0], [0]
    for n, u in zip(step.seq_lens, used):
        qo_indptr.append(qo_indptr[-1] + n)
        kv_indptr.append(kv_indptr[-1] + u)
    indices = [page for pages, u in zip(step.pages, used) for page in pages[:u]]
    last = [(n - 1) % ps + 1 for n in kv_lens]
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_i32(qo_indptr), as_i32(kv_indptr), as_i32(indices), as_i32(last)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FlashInferPlanner:
    """The FlashInfer wrappers of one runner and their plans for the current step.

    ``begin(step, graph_batch)`` starts a step (``graph_batch``: the decode batch size of the CUDA
    graph being captured or replayed; None: an eager forward). ``wrapper(key, max_pages)``, called
    by the op for each layer, returns the wrapper for ``key`` planned for this step -- created and
    planned on first use, never during capture (warm-up runs first). Replays do not call the op,
    so ``begin`` re-plans every wrapper the graph of ``graph_batch`` captured.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._workspace: Optional[torch.Tensor] = None  # shared: only used inside one run()
        self._wrappers: Dict[Tuple[Optional[int], PlanKey], object] = {}  # (graph batch, key) -> wrapper
        self._planned: Dict[Tuple[Optional[int], PlanKey], int] = {}  # -> step id it was planned for
        self._step: Optional[HostStep] = None
        self._step_id = 0
        self._graph_batch: Optional[int] = None
        self._indices: Optional[Tuple[torch.Tensor, ...]] = None  # host_indices of the step, made once
        self.plans = 0  # plan() calls so far (tests read it: once per step and key, not per layer)

    @property
    def step(self) -> Optional[HostStep]:
        return self._step

    def begin(self, step: HostStep, graph_batch: Optional[int]) -> None:
        if graph_batch is not None and len(step.seq_lens) != graph_batch:
            raise ValueError(
                f"a step of {len(step.seq_lens)} sequences cannot replay the graph of batch size "
                f"{graph_batch} (pad the step to it first)"
            )
        self._step, self._graph_batch, self._indices = step, graph_batch, None
        self._step_id += 1
        if graph_batch is not None:
            for slot, w in self._wrappers.items():
                if slot[0] == graph_batch:
                    self._plan(w, slot)

    def wrapper(self, key: PlanKey, max_pages_per_seq: int):
        if self._step is None:
            raise RuntimeError("FlashInferPlanner.wrapper before begin(): the runner plans each step first")
        slot = (self._graph_batch, key)
        w = self._wrappers.get(slot)
        if w is None:
            self._refuse_under_capture(key, "first seen")
            w = self._wrappers[slot] = self._new_wrapper(key, max_pages_per_seq)
        if self._planned.get(slot) != self._step_id:
            self._refuse_under_capture(key, "not planned for this step")
            self._plan(w, slot)
        return w

    def _refuse_under_capture(self, key: PlanKey, what: str) -> None:
        if _capturing():
            raise RuntimeError(
                f"flashinfer_cached_attention: a layer configuration {what} during CUDA-graph "
                f"capture ({key}); FlashInfer plans on the host, so the runner must run the step "
                "once outside capture (warm-up) before capturing it"
            )

    def _new_wrapper(self, key: PlanKey, max_pages_per_seq: int):
        import flashinfer

        if self._workspace is None:
            self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        b = self._graph_batch
        if b is None:
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=_KERNELS)
        # CUDA-graph mode: the index buffers sit at fixed addresses the captured kernels read;
        # plan() copies each step's indices into them (sized for b sequences of the longest length)
        i32: Dict[str, Any] = dict(dtype=torch.int32, device=self.device)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.empty(b + 1, **i32),
            paged_kv_indptr_buf=torch.empty(b + 1, **i32),
            paged_kv_indices_buf=torch.empty(b * max_pages_per_seq, **i32),
            paged_kv_last_page_len_buf=torch.empty(b, **i32),
            backend=_KERNELS,
        )

    def _plan(self, w, slot: Tuple[Optional[int], PlanKey]) -> None:
        key = slot[1]
        if self._indices is None:
            assert self._step is not None  # begin_step ran before any plan
            self._indices = host_indices(self._step)  # host tensors: plan() reads them without a sync
        qo_indptr, kv_indptr, kv_indices, last_page_len = self._indices
        w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, causal=True, **key.plan_arguments())
        self._planned[slot] = self._step_id
        self.plans += 1


# Calls outside a runner (numerics probe, tests): one planner per thread and device, re-planned
# whenever the step read from the metadata tensors changes. A cache of FlashInfer's workspaces,
# not state anything else reads.
_UNMANAGED = threading.local()


def _unmanaged_planner(device: torch.device, step: HostStep) -> FlashInferPlanner:
    planners = _UNMANAGED.__dict__.setdefault("planners", {})
    planner = planners.get(device)
    if planner is None:
        planner = planners[device] = FlashInferPlanner(device)
    if planner.step != step:
        planner.begin(step, None)
    return planner


def _refusal(call: CachedAttentionArgs) -> Optional[str]:
    """Why FlashInfer cannot serve this call (None: it can)."""
    q, k, v, k_cache, v_cache = call[:5]
    why = unsupported(q.shape[-1], v.shape[-1], q.dtype, call.sinks is not None)
    if why is None and k_cache.dtype not in FLASHINFER_DTYPES:
        why = f"KV cache dtype {str(k_cache.dtype).replace('torch.', '')} (FlashInfer takes float16 or bfloat16)"
    if why is None and (q.shape[2] % k.shape[2] or v_cache.dtype != k_cache.dtype):
        why = f"{q.shape[2]} query heads over {k.shape[2]} KV heads, caches {k_cache.dtype}/{v_cache.dtype}"
    if why is None and call.alibi_slopes is not None:
        why = ALIBI_UNSUPPORTED
    if why is None and call.chunk_size is not None:
        why = CHUNKED_UNSUPPORTED
    return why


def flashinfer_cached_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """FlashInfer paged attention; ``args``/``kwargs``: the shared cached-attention arguments
    (``CachedAttentionArgs``)."""
    call = CachedAttentionArgs(*args, **kwargs)
    why = _refusal(call)
    if why is not None:
        raise ValueError(
            f"flashinfer_cached_attention cannot serve this call: {why}. Use the {OTHER_BACKENDS} "
            "cached attention backend (insert_cached_attention.backend=triton)."
        )
    q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill, scale = call[:10]
    ok, missing = is_available(q.device)
    if not ok:
        raise RuntimeError(f"flashinfer_cached_attention cannot run: {missing}. Use the {OTHER_BACKENDS} backend.")
    t, page_size = q.shape[1], k_cache.shape[1]
    if k.is_cuda and HAS_TRITON:
        from .triton_kernels.paged_kv_append import append_paged_kv

        append_paged_kv(k[0], v[0], k_cache, v_cache, seq_lens, input_pos, page_table.contiguous())
    else:
        seq_idx, pos = token_layout(seq_lens, input_pos, t)
        write_kv(k[0], v[0], k_cache, v_cache, seq_idx, pos, page_table)
    planner = cast(Optional[FlashInferPlanner], active_planner("flashinfer"))  # registered under that name
    if planner is None:
        if _capturing():
            raise RuntimeError(
                "flashinfer_cached_attention is being captured in a CUDA graph outside the workbench "
                "runtime: FlashInfer plans each step on the host before a replay. Capture it through "
                "compile_model (torch-cudagraph), whose runner plans every step."
            )
        planner = _unmanaged_planner(
            q.device, HostStep.from_device(seq_lens, input_pos, page_table, page_size, int(num_prefill))
        )
    window, cap = call.sliding_window, call.logit_cap
    key = PlanKey(
        num_qo_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        head_dim_qk=q.shape[3],
        page_size=page_size,
        window_left=-1 if window is None else int(window) - 1,
        logits_soft_cap=float(cap) if cap else None,
        sm_scale=float(scale),
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    out = planner.wrapper(key, page_table.shape[1]).run(q[0].contiguous(), (k_cache, v_cache))  # [T, Hq, Dv]
    return out.to(q.dtype).unsqueeze(0)


define_cached_attention("flashinfer_cached_attention", flashinfer_cached_attention)

__all__ = ["flashinfer_cached_attention", "FlashInferPlanner", "PlanKey", "host_indices", "unsupported", "is_available"]
