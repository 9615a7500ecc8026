"""``compile_model`` (stage ``compile``): choose how the finished graph runs.

The graph itself is not changed (it stays printable and renderable, and the numerics probe keeps
running it); what changes is the *runner* ``generate`` uses, built here and handed on in
``ctx.runner`` so that its one-off cost (compilation warm-up, CUDA-graph capture) lands in this
transform's snapshot time and memory delta. The backends (``torch-simple``, ``torch-compile``,
``torch-cudagraph``, ``torch-opt``) and everything they know about runners live in
``workbench.runtime.backends`` (``COMPILE_BACKENDS``); this transform looks the backend up, checks
what only the pipeline knows -- a cache was allocated, every node of the graph can be captured in a
CUDA graph (``workbench.ops.capture``: each op declares whether it reads device values on the host)
-- and calls its ``build``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Union, get_args

import torch
from pydantic import Field, field_validator, model_validator

from ....ops.backends import AttentionBackend
from ....ops.capture import HOST_SYNC_TAG, capture_blockers, summarize_blockers
from ....ops.registry import Choice
from ....runtime.interface import COMPILE_BACKENDS, BuildRequest, CompileBackend, is_cached_module, module_input_names
from ...context import PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...memory import EXPECTED_MEM_CHANGE

logger = logging.getLogger("workbench.pipeline")

CompileBackendName = Literal["torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"]
if set(get_args(CompileBackendName)) != set(COMPILE_BACKENDS.names()):  # the config Literal follows the registry
    raise ImportError(
        f"compile_model's backend Literal {get_args(CompileBackendName)} differs from "
        f"COMPILE_BACKENDS {COMPILE_BACKENDS.names()}"
    )
CUDA_BACKENDS = tuple(b.name for b in COMPILE_BACKENDS if b.cuda_graphs)
# what a user can change when some node cannot be captured
CAPTURE_HINT = (
    "cached attention captures with insert_cached_attention.backend=triton or flashinfer; "
    "MoE dispatch and per-sequence state ops run outside CUDA graphs"
)
# why ``auto`` picks what it picks (``COMPILE_BACKENDS.auto_order``), said in the snapshot's details
AUTO_NOTES = {"cpu": " (fastest decode measured there)", "cuda": " (every node of the graph can be captured)"}


def capture_hint(attention: Optional[Choice[AttentionBackend]]) -> str:
    """What a user can change so the graph captures. Names the graph's cached-attention choice (the
    ``ctx.cache.attention`` fact) when its op is one that reads device values on the host."""
    if attention is None or HOST_SYNC_TAG not in attention.backend.op.tags:
        return CAPTURE_HINT
    return f"the cached attention is {attention.name!r} ({attention.why}): " + CAPTURE_HINT


def choose_backend(
    name: str, device: torch.device, blockers: Mapping[str, str], attention: Optional[Choice[AttentionBackend]] = None
) -> Choice[CompileBackend]:
    """The compile backend for ``name`` (``auto``: ``COMPILE_BACKENDS.auto_order``) on ``device``,
    given the graph's ``capture_blockers``: a CUDA-graph backend is refused while any node blocks
    (the refusal names the ``attention`` choice when that is what blocks)."""

    def refuse(backend: CompileBackend) -> Optional[str]:
        if backend.cuda_graphs and blockers:
            return (
                f"cannot capture this graph in CUDA graphs: {summarize_blockers(blockers)}; {capture_hint(attention)}"
            )
        return None

    choice = COMPILE_BACKENDS.choose(name, device, "compile_model.backend", refuse=refuse)
    if name == "auto" and "passed over" not in choice.why:
        choice = Choice(choice.backend, choice.why + AUTO_NOTES.get(torch.device(device).type, ""))
    return choice


def resolve_auto(device: torch.device, blockers: Mapping[str, str]) -> Tuple[str, str]:
    """(backend, why) for ``backend: auto`` on ``device``, given the graph's ``capture_blockers``."""
    choice = choose_backend("auto", device, blockers)
    return choice.name, choice.why


class CompileModelConfig(TransformConfig):
    backend: Union[Literal["auto"], CompileBackendName] = Field(
        default="auto",
        description="The backend to use for compiling the model; 'auto': the fastest for the "
        "device (CPU: torch-simple over the C++ kernels; CUDA: torch-cudagraph when every node of the graph can be "
        "captured, else torch-simple), reported in the snapshot's details.",
    )
    cuda_graph_batch_sizes: Optional[List[int]] = Field(
        default=None,
        description="The batch sizes to use for CUDA graphs. None: 1, 2, 4, 8, 16, 24, 32, "
        "48, 64, ... up to the KV cache's max_batch_size.",
    )
    num_batched_inputs: Optional[int] = Field(
        default=None,
        ge=1,
        description="The number of batched inputs to use for CUDA graphs. If unset, "
        "infer it from runtime inputs by excluding explicit cache/resource inputs.",
    )
    static_decode_batch_sizes: Optional[List[int]] = Field(
        default=None,
        description="torch-compile on CPU: decode steps of exactly these batch sizes run a "
        "static-shape Inductor graph called without Dynamo (no guards, no Python frame around the C++ "
        "wrapper: ~0.7 ms a token less on SmolLM2), each compiled here and checked against the graph. "
        "Other steps go through torch.compile. None: [1]; []: off. Ignored by the other backends.",
    )
    piecewise_enabled: bool = Field(
        default=False, description="Enable piecewise CUDA graph for prefill/mixed batches (dual-mode)."
    )
    piecewise_num_tokens: Optional[List[int]] = Field(
        default=None,
        description="Total token counts to pre-capture piecewise CUDA graphs for. If null "
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

    @field_validator("static_decode_batch_sizes")
    @classmethod
    def _positive_or_empty(cls, v: Optional[List[int]]) -> Optional[List[int]]:
        if v is not None and any(int(x) < 1 for x in v):
            raise ValueError(f"must be positive batch sizes ([] turns static decode graphs off), got {v}")
        return v if v is None else sorted(set(int(x) for x in v))

    @model_validator(mode="after")
    def _cuda_fields_need_a_cuda_backend(self) -> "CompileModelConfig":
        if self.piecewise_enabled and self.backend not in (*CUDA_BACKENDS, "auto"):
            raise ValueError(
                f"piecewise_enabled needs a CUDA-graph backend ({' or '.join(CUDA_BACKENDS)}), not {self.backend!r}"
            )
        return self


def backend_unavailable_reason(backend: str, device: torch.device | str) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` (None if it can); the widgets ask this too."""
    if backend == "auto":
        return None  # resolves to a backend that runs here
    if backend not in COMPILE_BACKENDS:
        return f"unknown compile backend {backend!r}"
    return COMPILE_BACKENDS.get(backend).unavailable_reason(torch.device(device))


def batched_input_count(gm: torch.nn.Module, cache_keys) -> int:
    """Inputs that carry the batch (everything but cache/resource tensors)."""
    return sum(1 for n in module_input_names(gm) if n not in cache_keys)


@register("compile_model")
class CompileModel(Transform[CompileModelConfig]):
    """Build the runner ``generate`` uses: plain graph, torch.compile, CUDA graphs, or both."""

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        c = self.config
        # nodes a CUDA graph cannot capture (only CUDA runs graphs: elsewhere a CUDA-graph backend is
        # refused as unavailable)
        blockers = capture_blockers(gm) if torch.device(ctx.device).type == "cuda" else {}
        choice = choose_backend(c.backend, ctx.device, blockers, ctx.cache.attention)
        name, chosen, backend = choice.name, choice.why, choice.backend
        details: Dict[str, Any] = {"backend": name, "chosen": chosen}
        if blockers:
            details["capture_blockers"] = dict(blockers)
        if not backend.torch_compile and not backend.cuda_graphs:
            ctx.runner = None  # generate builds the plain runner for the graph
            return gm, TransformInfo(num_matches=0, details=details)
        if not is_cached_module(gm):
            raise RuntimeError(
                f"backend {name!r} compiles the cached graph, but no cache stage ran "
                "(enable insert_cached_attention and initialize_cache)"
            )
        cfg = ctx.cache.require_config(self.key)
        batched = batched_input_count(gm, set(ctx.cache.tensors))
        if c.num_batched_inputs is not None and c.num_batched_inputs != batched:
            raise ValueError(
                f"num_batched_inputs={c.num_batched_inputs}, but the graph has {batched} batched "
                f"inputs (tokens, positions and step metadata); leave it unset to infer it"
            )
        details["num_batched_inputs"] = batched
        built = backend.build(
            BuildRequest(
                module=gm,
                caches=ctx.cache.tensors,
                cache_config=cfg,
                device=ctx.device,
                cuda_graph_batch_sizes=c.cuda_graph_batch_sizes,
                piecewise_enabled=c.piecewise_enabled,
                piecewise_num_tokens=c.piecewise_num_tokens,
                static_decode_batch_sizes=c.static_decode_batch_sizes,
            )
        )
        details.update(built.details)
        if built.allocates_cuda_memory:  # e.g. CUDA-graph pools: memory the stepper must not flag
            details[EXPECTED_MEM_CHANGE] = built.allocates_cuda_memory
        ctx.runner = built.runner
        return gm, TransformInfo(num_matches=0, details=details)


__all__ = ["CompileModel", "CompileModelConfig", "backend_unavailable_reason", "CUDA_BACKENDS"]
