"""The compile backends: how a finished cached graph runs under ``generate``.

=================  ===============================================================================
``torch-simple``   the graph module as is (no runner is built: ``generate`` makes the plain one)
``torch-compile``  ``torch.compile(graph, dynamic=True)``: one compilation serves every batch shape
``torch-cudagraph`` CUDA graphs captured per decode batch size (``cuda_graph_batch_sizes``); a
                   decode batch is padded up to the nearest captured size; prefill/mixed steps and
                   larger batches run eagerly, or with ``piecewise`` replay graphs captured per
                   token bucket between eager attention calls
``torch-opt``      ``torch.compile`` and then CUDA graphs of the compiled forward (and of the
                   compiled pieces, with ``piecewise``)
=================  ===============================================================================

For ``torch.compile`` the graph is copied and its torch-backend canonical ops are inlined as plain
functions in the copy, so Inductor fuses them with their neighbours; cached attention stays an
opaque op. After building, ``self_check`` runs a decode step on the scratch page through the runner
and through the plain graph and reports the largest logit difference (and the same for a padded
one-page prefill with piecewise graphs). ``compile_model`` (a pipeline transform) only looks the
backend up, checks what the pipeline knows (cache allocated, attention backend capturable) and
calls ``build``: everything that knows about runners lives here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from ..ops.inline import inline_canonical_ops
from ..ops.registry import Backend, BackendRegistry
from .compiled_runner import CompiledRunner, CudaGraphRunner, default_batch_sizes
from .kv_cache import KVCacheConfig
from .piecewise import PiecewiseGraphs, default_token_buckets


@dataclass(frozen=True)
class BuildRequest:
    """What a compile backend needs: the cached graph, its caches and the knobs of ``compile_model``."""

    module: fx.GraphModule
    caches: Mapping[str, torch.Tensor]
    cache_config: KVCacheConfig
    device: torch.device
    cuda_graph_batch_sizes: Optional[List[int]] = None
    piecewise_enabled: bool = False
    piecewise_num_tokens: Optional[List[int]] = None
    static_decode_batch_sizes: Optional[List[int]] = None  # None: the backend's default


@dataclass
class Built:
    """A backend's result: the runner ``generate`` uses (None: the plain one) and facts to report."""

    runner: Any = None
    details: Dict[str, Any] = field(default_factory=dict)
    allocates_cuda_memory: Optional[str] = None  # why the allocator grows, if it does (graph pools)


@dataclass(frozen=True)
class CompileBackend(Backend):
    """One way of running the cached graph. ``torch_compile``: Inductor compiles an inlined copy;
    ``cuda_graphs``: captures CUDA graphs (needs CUDA and an attention op that never reads step
    metadata on the host)."""

    description: str = ""
    torch_compile: bool = False
    cuda_graphs: bool = False

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        device = torch.device(device)
        if not self.cuda_graphs:
            return None
        if device.type != "cuda":
            return f"{self.name} captures CUDA graphs and needs a CUDA device; this pipeline runs on {device.type}"
        if not torch.cuda.is_available():
            return f"{self.name} captures CUDA graphs but CUDA is not available on this machine"
        return None

    def build(self, req: BuildRequest) -> Built:
        if not self.torch_compile and not self.cuda_graphs:
            return Built()
        details: Dict[str, Any] = {}
        fn = inlined = req.module
        if self.torch_compile:
            inlined, counts = inlined_copy(req.module)
            if req.device.type == "cpu":
                # the cache tensors are the same ones, of the same sizes, for the runner's life. With
                # their sizes symbolic (dynamic=True) Dynamo's shape guards compared every cache's sizes
                # and strides with the others' (smollm2: 2,626 comparisons in the logged guard
                # functions, 106 with the caches static); compile_options drops their tensor guards
                for cache in req.caches.values():
                    torch._dynamo.mark_static(cache)
            fn = torch.compile(inlined, dynamic=True, options=compile_options(req.device, cache_inputs=req.caches))
            details["inlined_ops"] = counts
        cfg = req.cache_config
        if not self.cuda_graphs:
            runner = CompiledRunner(req.module, req.caches, cfg, req.device, fn)
            if min(cfg.max_batch_size, 2) != 1:
                # compile the single-sequence decode here (a guard of cpu_linear_wxt's one-row path
                # gives it its own graph), not in the user's first generate. With a static bs-1
                # graph this Dynamo graph goes unused, but Dynamo's later graphs depend on the sizes
                # it has seen: without this call first, the one-sequence prefill's graph came out
                # specialised to one sequence and the first prefill of several compiled one more
                # (smollm2 Q4_1 on 2 cores, cold caches: +60 s, TORCH_LOGS=recompiles)
                runner.scratch_decode_logits(1)
            static = static_decode_sizes(req, self.torch_compile)
            if static:
                details.update(runner.add_static_decode(inlined, static, inductor_options(req.device)))
            details.update(self_check(runner, req.module, replay=False))
            return Built(runner, details)
        sizes = req.cuda_graph_batch_sizes or default_batch_sizes(cfg.max_batch_size)
        pieces = self._piecewise(req, inlined, details) if req.piecewise_enabled else None
        runner = CudaGraphRunner(req.module, req.caches, cfg, req.device, sizes, fn, piecewise=pieces)
        details["cuda_graph_batch_sizes"] = sizes
        if pieces is not None:
            n = max(1, min(cfg.page_size, pieces.buckets[0] - 1))  # < the bucket: padding is checked
            got = runner.scratch_prefill_logits(n)
            details["piecewise_check_max_abs_diff"] = float(
                (got - runner.scratch_prefill_logits(n, fn=req.module)).abs().max()
            )
        details.update(self_check(runner, req.module, replay=True))
        # Captured graphs keep their own allocator pool (activations of every captured size).
        return Built(runner, details, allocates_cuda_memory="CUDA-graph memory pool of the captured graphs")

    def _piecewise(self, req: BuildRequest, gm: fx.GraphModule, details: Dict[str, Any]) -> PiecewiseGraphs:
        """The piecewise graphs of ``gm`` for prefill/mixed steps, buckets checked against the cache."""
        cfg = req.cache_config
        buckets = req.piecewise_num_tokens or default_token_buckets(cfg.max_num_tokens)
        if buckets[-1] > cfg.max_num_tokens:
            raise ValueError(
                f"piecewise_num_tokens {[b for b in buckets if b > cfg.max_num_tokens]} exceed the "
                f"KV cache's max_num_tokens={cfg.max_num_tokens}; lower them or raise "
                "initialize_cache.max_num_tokens"
            )
        pieces = PiecewiseGraphs(gm, buckets, use_cuda_graphs=True, compile_pieces=self.torch_compile)
        details.update(piecewise_num_tokens=pieces.buckets, piecewise_captured_pieces=pieces.num_captured_pieces)
        return pieces


def static_decode_sizes(req: BuildRequest, torch_compile: bool) -> List[int]:
    """The decode batch sizes that get a static graph called without Dynamo (``static_decode``):
    torch-compile on CPU only (CUDA steps replay CUDA graphs, where Dynamo's per-call cost is paid
    once per capture); ``None`` asks for batch size 1, where that cost weighs the most."""
    sizes = req.static_decode_batch_sizes
    if not torch_compile or req.device.type != "cpu":
        return []
    if sizes is None:
        sizes = [1]
    too_big = [b for b in sizes if b > req.cache_config.max_batch_size]
    if too_big:
        raise ValueError(
            f"static_decode_batch_sizes {too_big} exceed the KV cache's max_batch_size="
            f"{req.cache_config.max_batch_size}; lower them or raise initialize_cache.max_batch_size"
        )
    return sorted(set(sizes))


def inlined_copy(gm: fx.GraphModule) -> Tuple[fx.GraphModule, Dict[str, int]]:
    """A copy of ``gm`` whose canonical torch ops are inlined, for ``torch.compile`` (Inductor fuses
    them with their neighbours), and the count of inlined calls per op; parameters and buffers stay
    shared with ``gm``."""
    copy = fx.GraphModule(gm, _copy_graph(gm.graph))  # an eager GraphModule: dynamo reads its forward
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy, inline_canonical_ops(copy)


def compile_options(device: torch.device, cache_inputs: Iterable[str] = ()) -> Dict[str, Any]:
    """Inductor options of the torch.compile backends. On CPU a decode step is a few hundred calls of
    small kernels, so the per-call cost of the generated wrapper is the step's overhead:

    * not ``cpp_wrapper``: a C++ wrapper calls kernels without the Python interpreter (SmolLM2 Q4_1
      bs=1 on 2 cores, runners alternated: 14.6 -> 13.1 ms a token), but an error raised by an op it
      calls cannot cross it -- the process aborts instead of raising -- and in a long pytest worker
      (``make test``, torch 2.13) its first call, which runs torch's custom-op aliasing check
      through every workbench op it dispatches, died with "double free or corruption" on the
      tiny-llama decode graph that runs cleanly in a fresh process. The Python wrapper raises;
      torch-compile is not the CPU default (torch-simple is), so its steps keep that 10 %;
    * no guards on the module's own attributes (``self._modules[...]``: ~1100 type/tensor checks a
      call, on weights that this compiled copy alone owns and that no step replaces -- a pipeline that
      changes weights re-runs ``compile_model``, which compiles again) nor on ``cache_inputs``, the
      cache tensors the runner passes, the same ones every step, for the runner's life. Guards on
      the step's own inputs (token ids, positions, page table: shapes, the one-row specialisation) stay;
    * no size/alignment asserts on every input (~430 weights) and op output per call: ``self_check``
      compares the compiled runner with the plain graph after every build instead.

    CUDA keeps the defaults (its steps replay CUDA graphs, where the wrapper runs once per capture)."""
    if torch.device(device).type != "cpu":
        return {}
    static = frozenset(cache_inputs)

    def keep(entries: List[Any]) -> List[bool]:
        # the module is named ``self`` (torch 2.13: "self._modules[...]"), ``L['self']`` in older names
        return [
            not (e.name.startswith(("self.", "self[", "L['self']")) or _input_name(e.name) in static) for e in entries
        ]

    return {**inductor_options(device), "guard_filter_fn": keep}


def inductor_options(device: torch.device) -> Dict[str, Any]:
    """The Inductor config part of ``compile_options`` (what a graph compiled without Dynamo, as the
    static decode graphs are, takes): the Python wrapper, no size/alignment asserts; CPU only."""
    if torch.device(device).type != "cpu":
        return {}
    return {
        "cpp_wrapper": False,
        "size_asserts": False,
        "alignment_asserts": False,
        "post_grad_custom_pre_pass": _workbench_ops_key_class()(),
    }


@functools.lru_cache(maxsize=None)
def _workbench_ops_key_class() -> type:
    """``_WorkbenchOpsKey``, made on first use: ``torch._inductor`` imports Dynamo and Triton (~1 s,
    ~140 MB after ``import torch``), which a run that never compiles should not pay at import time."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _WorkbenchOpsKey(CustomGraphPass):
        """A pass that changes nothing and whose ``uuid`` -- part of Inductor's FX-graph cache key -- is
        a hash of the workbench ops' schemas. A graph omits an op's defaulted arguments, so after an op
        gains one (``alibi_slopes``, ``chunk_size``) the same graph keyed the same: Inductor reloaded
        C++-wrapper code built for the old schema, and its boxed call crashed the process."""

        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return _ops_schema_hash()

    return _WorkbenchOpsKey


def _ops_schema_hash() -> str:
    import hashlib

    schemas = sorted(str(op.default._schema) for op in _workbench_ops())
    return hashlib.sha256("\n".join(schemas).encode()).hexdigest()


def _workbench_ops() -> List[Any]:
    ns = torch.ops.workbench
    return [getattr(ns, name) for name in dir(ns) if hasattr(getattr(ns, name, None), "default")]


def _input_name(guard_name: str) -> str:
    """``k_cache_0`` of a guard on the input ``k_cache_0`` (named bare or ``L['k_cache_0']``)."""
    if guard_name.startswith("L['"):
        return guard_name[3:].split("'", 1)[0]
    return guard_name.split(".", 1)[0].split("[", 1)[0]


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    new._codegen = graph._codegen
    return new


def self_check(runner: CompiledRunner, module: fx.GraphModule, replay: bool) -> Dict[str, float]:
    """Largest logit difference of a scratch decode step (2 sequences where the cache allows)
    through the runner (replaying its captured graph with ``replay``) and through the plain graph."""
    b = min(runner.cfg.max_batch_size, 2)
    if replay:
        assert isinstance(runner, CudaGraphRunner)  # only a CUDA-graph runner replays
        got = runner.replayed_scratch_decode_logits(b)
    else:
        got = runner.scratch_decode_logits(b)
    ref = runner.scratch_decode_logits(b, fn=module)
    return {"check_max_abs_diff": float((got - ref).abs().max())}


COMPILE_BACKENDS: BackendRegistry[CompileBackend] = BackendRegistry(
    "compile",
    [
        CompileBackend("torch-simple", "nothing beyond PyTorch", "the graph module as is"),
        CompileBackend(
            "torch-compile",
            "nothing beyond PyTorch",
            "torch.compile(dynamic=True) of an inlined copy",
            torch_compile=True,
        ),
        CompileBackend(
            "torch-cudagraph",
            "a CUDA GPU and a capturable attention backend (triton, flashinfer)",
            "CUDA graphs per decode batch size",
            cuda_graphs=True,
        ),
        CompileBackend(
            "torch-opt",
            "a CUDA GPU and a capturable attention backend (triton, flashinfer)",
            "torch.compile, then CUDA graphs of the compiled forward",
            torch_compile=True,
            cuda_graphs=True,
        ),
        # auto: CUDA graphs on CUDA when the graph can be captured (compile_model refuses them otherwise), else
        # the plain graph; CPU: the plain graph over the C++ kernels, chosen for the time to an answer (the
        # first torch-compile of a model costs 2-4 min of C++ compilation on 2 cores; its decode is faster:
        # docs/benchmarks.md)
    ],
    default="torch-simple",
    auto_order={"cuda": ("torch-cudagraph", "torch-simple"), "cpu": ("torch-simple",)},
)


__all__ = ["COMPILE_BACKENDS", "CompileBackend", "BuildRequest", "Built", "inlined_copy", "self_check"]
