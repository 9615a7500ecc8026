"""``compile_model`` (stage ``compile``): choose how the finished graph runs.

The graph itself is not changed (it stays printable and renderable, and the numerics probe keeps
running it); what changes is the *runner* ``generate`` uses, built here and handed on in
``ctx.shared['runner']`` so that its one-off cost (compilation warm-up, CUDA-graph capture) lands
in this transform's snapshot time and memory delta:

=================  ===============================================================================
``torch-simple``   the graph module as is
``torch-compile``  ``torch.compile(graph, dynamic=True)``: one compilation serves every batch shape
``torch-cudagraph`` CUDA graphs captured per decode batch size (``cuda_graph_batch_sizes``); a
                   decode batch is padded up to the nearest captured size; prefill/mixed steps and
                   larger batches run eagerly, or with ``piecewise_enabled`` replay graphs captured
                   per token bucket (``piecewise_num_tokens``) between eager attention calls
``torch-opt``      ``torch.compile`` and then CUDA graphs of the compiled forward (and of the
                   compiled pieces, with ``piecewise_enabled``)
=================  ===============================================================================

For ``torch.compile`` the graph is copied and its torch-backend canonical ops (RMSNorm, RoPE,
SiLU*mul, the CPU linear ``cpu_linear_wxt``) are inlined as plain functions in the copy, so Inductor
can fuse them with the surrounding element-wise work; cached attention stays an opaque op. The CUDA backends need a CUDA device and an attention backend that never synchronises with the
host inside the graph (``triton`` or ``flashinfer``; the ``torch`` reference reads sequence lengths
on the host): both are checked up front with an error that says what to change. After building
the runner, a decode step on the scratch page is run through it and through the plain graph; the
largest logit difference is reported in the snapshot details (``check_max_abs_diff``), and with
piecewise graphs the same for a padded one-page prefill (``piecewise_check_max_abs_diff``).
"""

from __future__ import annotations

import logging
from typing import List, Literal, Optional, Tuple

import torch
from pydantic import Field, field_validator, model_validator

from ..interface import Transform, TransformConfig, TransformInfo, register
from ..memory import EXPECTED_MEM_CHANGE

logger = logging.getLogger("workbench.pipeline")

CompileBackend = Literal["torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"]
CUDA_BACKENDS = ("torch-cudagraph", "torch-opt")
RUNNER_KEY = "runner"
# cached attention ops that read metadata on the host (cannot be captured in a CUDA graph)
HOST_SYNCING_ATTENTION = ("torch_cached_attention",)


class CompileModelConfig(TransformConfig):
    backend: CompileBackend = Field(description="The backend to use for compiling the model.")
    cuda_graph_batch_sizes: Optional[List[int]] = Field(
        default=None, description="The batch sizes to use for CUDA graphs. None: 1, 2, 4, 8, 16, 24, 32, "
        "48, 64, ... up to the KV cache's max_batch_size.",
    )
    num_batched_inputs: Optional[int] = Field(
        default=None, ge=1, description="The number of batched inputs to use for CUDA graphs. If unset, "
        "infer it from runtime inputs by excluding explicit cache/resource inputs.",
    )
    piecewise_enabled: bool = Field(
        default=False, description="Enable piecewise CUDA graph for prefill/mixed batches (dual-mode)."
    )
    piecewise_num_tokens: Optional[List[int]] = Field(
        default=None, description="Total token counts to pre-capture piecewise CUDA graphs for. If null "
        "and piecewise_enabled=true, auto-generates power-of-2 buckets up to max_num_tokens.",
    )

    @field_validator("cuda_graph_batch_sizes", "piecewise_num_tokens")
    @classmethod
    def _positive_sorted(cls, v: Optional[List[int]]) -> Optional[List[int]]:
        if v is None:
            return v
        if not v or any(int(x) < 1 for x in v):
            raise ValueError(f"must be a non-empty list of positive integers, got {v}")
        return sorted(set(int(x) for x in v))

    @model_validator(mode="after")
    def _cuda_fields_need_a_cuda_backend(self) -> "CompileModelConfig":
        if self.piecewise_enabled and self.backend not in CUDA_BACKENDS:
            raise ValueError(f"piecewise_enabled needs a CUDA-graph backend ({' or '.join(CUDA_BACKENDS)}), "
                             f"not {self.backend!r}")
        return self


def backend_unavailable_reason(backend: str, device: torch.device | str) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` (None if it can); the widgets ask this too."""
    device = torch.device(device)
    if backend in ("torch-simple", "torch-compile"):
        return None
    if backend in CUDA_BACKENDS:
        if device.type != "cuda":
            return f"{backend} captures CUDA graphs and needs a CUDA device; this pipeline runs on {device.type}"
        if not torch.cuda.is_available():
            return f"{backend} captures CUDA graphs but CUDA is not available on this machine"
        return None
    return f"unknown compile backend {backend!r}"


def _host_syncing_attention(gm: torch.fx.GraphModule) -> List[str]:
    return sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                   and any(name in str(n.target) for name in HOST_SYNCING_ATTENTION)})


def batched_input_count(gm: torch.fx.GraphModule, cache_keys) -> int:
    """Inputs that carry the batch (everything but cache/resource tensors)."""
    from ...runtime.sequence_info import module_input_names

    return sum(1 for n in module_input_names(gm) if n not in cache_keys)


@register("compile_model")
class CompileModel(Transform):
    """Build the runner ``generate`` uses: plain graph, torch.compile, CUDA graphs, or both."""

    config_class = CompileModelConfig

    def _apply(self, gm, ctx) -> Tuple[torch.nn.Module, TransformInfo]:
        from ...runtime.compiled_runner import CompiledRunner, CudaGraphRunner, default_batch_sizes
        from ...runtime.sequence_info import is_cached_module

        c: CompileModelConfig = self.config
        why = backend_unavailable_reason(c.backend, ctx.device)
        if why is not None:
            raise RuntimeError(f"{why}. Use backend 'torch-simple' or 'torch-compile' here, or run the pipeline "
                               "with device='cuda' on a GPU machine.")
        details = {"backend": c.backend}
        if c.backend == "torch-simple":
            ctx.shared.pop(RUNNER_KEY, None)  # generate builds the plain runner for the graph
            return gm, TransformInfo(num_matches=0, details=details)
        if not is_cached_module(gm):
            raise RuntimeError(f"backend {c.backend!r} compiles the cached graph, but no cache stage ran "
                               "(enable insert_cached_attention and initialize_cache)")
        cfg = ctx.shared.get("kv_cache_config")
        if cfg is None:
            raise RuntimeError("the graph takes cache inputs but no KV cache was allocated: enable initialize_cache")
        cache_keys = set(ctx.resources)
        batched = batched_input_count(gm, cache_keys)
        if c.num_batched_inputs is not None and c.num_batched_inputs != batched:
            raise ValueError(f"num_batched_inputs={c.num_batched_inputs}, but the graph has {batched} batched "
                             f"inputs (tokens, positions and step metadata); leave it unset to infer it")
        details["num_batched_inputs"] = batched
        fn = inlined_gm = gm
        if c.backend in ("torch-compile", "torch-opt"):
            inlined_gm, inlined = inlined_copy(gm)
            fn = torch.compile(inlined_gm, dynamic=True)
            details["inlined_ops"] = inlined
        if c.backend == "torch-compile":
            runner = CompiledRunner(gm, ctx.resources, cfg, ctx.device, fn)
        else:
            syncing = _host_syncing_attention(gm)
            if syncing:
                raise RuntimeError(f"{c.backend} cannot capture {syncing}: that attention backend reads sequence "
                                   "lengths on the host. Set insert_cached_attention.backend to 'triton' (or "
                                   "'flashinfer') for CUDA graphs")
            sizes = c.cuda_graph_batch_sizes or default_batch_sizes(cfg.max_batch_size)
            pieces = _piecewise(c, inlined_gm, cfg, details) if c.piecewise_enabled else None
            runner = CudaGraphRunner(gm, ctx.resources, cfg, ctx.device, sizes, fn, piecewise=pieces)
            details["cuda_graph_batch_sizes"] = sizes
            # Captured graphs keep their own allocator pool (activations of every captured size):
            # memory the stepper must not flag as a surprise.
            details[EXPECTED_MEM_CHANGE] = "CUDA-graph memory pool of the captured graphs"
            if pieces is not None:
                n = max(1, min(cfg.page_size, pieces.buckets[0] - 1))  # < the bucket: padding is checked
                got = runner.scratch_prefill_logits(n)
                details["piecewise_check_max_abs_diff"] = float((got - runner.scratch_prefill_logits(n, fn=gm))
                                                                .abs().max())
        check_b = min(cfg.max_batch_size, 2)
        if c.backend == "torch-compile" and check_b != 1:
            # compile the single-sequence decode here (a guard of cpu_linear_wxt's one-row path gives it
            # its own graph), not in the user's first generate
            runner.scratch_decode_logits(1)
        got = runner.scratch_decode_logits(check_b) if c.backend == "torch-compile" else _replayed(runner, check_b)
        ref = runner.scratch_decode_logits(check_b, fn=gm)
        details["check_max_abs_diff"] = float((got - ref).abs().max())
        ctx.shared[RUNNER_KEY] = runner
        return gm, TransformInfo(num_matches=0, details=details)


def inlined_copy(gm: torch.fx.GraphModule):
    """A copy of ``gm`` whose canonical torch ops are inlined, for ``torch.compile`` (Inductor fuses
    them with their neighbours), and the count of inlined calls per op; parameters and buffers stay
    shared with ``gm``."""
    from ...ops.inline import inline_canonical_ops
    from ..graph_utils import copy_module

    copy = copy_module(gm)
    return copy, inline_canonical_ops(copy)


def _piecewise(c: CompileModelConfig, gm: torch.fx.GraphModule, cfg, details):
    """The piecewise graphs of ``gm`` for prefill/mixed steps, buckets checked against the cache."""
    from ...runtime.piecewise import PiecewiseGraphs, default_token_buckets

    buckets = c.piecewise_num_tokens or default_token_buckets(cfg.max_num_tokens)
    if buckets[-1] > cfg.max_num_tokens:
        raise ValueError(f"piecewise_num_tokens {[b for b in buckets if b > cfg.max_num_tokens]} exceed the KV "
                         f"cache's max_num_tokens={cfg.max_num_tokens}; lower them or raise "
                         "initialize_cache.max_num_tokens")
    pieces = PiecewiseGraphs(gm, buckets, use_cuda_graphs=True, compile_pieces=c.backend == "torch-opt")
    details.update(piecewise_num_tokens=pieces.buckets, piecewise_captured_pieces=pieces.num_captured_pieces)
    return pieces


def _replayed(runner, batch_size: int) -> torch.Tensor:
    """Logits of a scratch decode step replayed from the captured graph for ``batch_size``."""
    b = runner.bucket(batch_size)
    runner.set_scratch_decode(b)
    runner.graphs[b].replay()
    return runner.outputs[b][0, :batch_size].float().clone()


__all__ = ["CompileModel", "CompileModelConfig", "backend_unavailable_reason", "CUDA_BACKENDS", "RUNNER_KEY"]
