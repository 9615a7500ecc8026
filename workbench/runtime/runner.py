"""Runners: one scheduled ``Step`` in, next-token logits of each sequence out.

``CachedRunner`` drives a cache-enabled module -- the graph after the cache stage, or
``HFCachedLM`` in transformers mode -- through a ``SequenceInfo``: only the new tokens of each
sequence are fed, the K/V of earlier tokens come from the paged caches. ``UncachedRunner`` is the
fallback for a pipeline without a cache stage: every step re-runs each sequence's whole history
through the plain ``(input_ids, position_ids) -> logits`` contract (quadratic, but always right).

Both run eagerly today; a ``torch.compile`` or CUDA-graph runner slots in here with the same
``step`` signature (the fixed-address buffers of ``SequenceInfo`` are what a CUDA graph captures).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
import torch.fx as fx

from ..errors import InputError
from ..ops.library import activation_rounding
from ..ops.step_plan import planned, planners_for
from .kv_cache import PAGED, SLOT, KVCacheConfig, PageAllocator, allocate_caches
from .lean_graph import lean_copy
from .limits import RuntimeLimits
from .scheduler import Scheduler, Step
from .sequence_info import LAST_TOKEN_INPUT, SequenceInfo, is_cached_module, module_input_names
from .step_program import build as build_step_program

logger = logging.getLogger("workbench.runtime")


def describe_caches(cfg: KVCacheConfig) -> str:
    """How a cached runner reaches earlier tokens: "paged KV cache", "per-sequence state", or both."""
    kinds = {s.kind for s in cfg.specs}
    parts = (["paged KV cache"] if PAGED in kinds or not kinds else []) + (
        ["per-sequence state"] if SLOT in kinds else []
    )
    return " + ".join(parts)


class CachedRunner:
    """Runs steps on a cached module with the caches of a ``KVCacheConfig``."""

    def __init__(
        self,
        module: torch.nn.Module,
        caches: Mapping[str, torch.Tensor],
        cfg: KVCacheConfig,
        device: torch.device | str = "cpu",
    ):
        self.module, self.cfg, self.device = module, cfg, torch.device(device)
        self.input_names = module_input_names(module)
        self.seq_info = SequenceInfo.from_config(cfg, self.device)
        static = set(self.seq_info.inputs())
        missing = [n for n in self.input_names if n not in static and n not in caches]
        if missing:
            raise ValueError(f"no cache tensors for the module inputs {missing}; did initialize_cache run?")
        released = [n for n in self.input_names if n in caches and caches[n].untyped_storage().nbytes() == 0]
        if released:
            raise ValueError(
                f"cache tensors {released[:3]} were released (by resize_kv_cache on a GPU); re-run resize_kv_cache"
            )
        self.caches: Dict[str, torch.Tensor] = {n: caches[n] for n in self.input_names if n in caches}
        # The page ids the runner hands out go up to cfg.num_pages - 1 (the scratch page): a pool
        # tensor with fewer pages would be written past its end by a kernel that trusts them.
        short = [
            f"{s.name} has {self.caches[s.name].shape[0]}"
            for s in cfg.specs
            if s.kind == PAGED and s.name in self.caches and self.caches[s.name].shape[0] < cfg.num_pages
        ]
        if short:
            raise ValueError(
                f"cache tensors hold fewer pages than the cache config's {cfg.num_pages}: {', '.join(short[:3])}; "
                "re-run initialize_cache (and resize_kv_cache) so tensors and config agree"
            )
        self.fn: Callable[..., Any] = module  # what runs a forward; compiled runners swap in a compiled callable
        self.step_form = "module"  # what self.fn is, in words (runner_for says: C++ step program, Python graph)
        self.cache_mode = describe_caches(cfg)
        slot_names = {s.name for s in cfg.specs if s.kind == SLOT}
        self.slot_states = [t for n, t in self.caches.items() if n in slot_names]
        # gather_logits_before_lm_head: the module returns one row per sequence, not per token
        self.gathers_last_tokens = LAST_TOKEN_INPUT in self.input_names
        # ops that plan each step on the host (FlashInfer attention): this runner's own planners
        self.planners = planners_for(module, self.device)
        # the decode layout in the buffers (set_step continues it when the next step is its advance)
        self._layout: Optional[Any] = None
        self.advanced_steps = 0  # decode steps that only advanced the buffers
        # the module's inputs per (sequences, tokens, prefills): views of fixed buffers, built once
        self._input_lists: Dict[Tuple[int, int, int], List[Any]] = {}

    def planned(self, graph_batch: Optional[int] = None):
        """Context for one forward (or the replay of the graph of ``graph_batch``) of the step in
        ``seq_info``: plans it on this runner's planners, which the ops then find."""
        if not self.planners:
            return nullcontext()
        return planned(self.planners, self.seq_info.host_step(), graph_batch)

    def scheduler(self) -> Scheduler:
        """A fresh scheduler over all pages: nothing from an earlier ``generate`` leaks in."""
        return Scheduler(self.cfg, PageAllocator(self.cfg.num_pages))

    def set_step(self, step: Step, sched: Scheduler, pad_to: Optional[int] = None) -> None:
        """Fill the fixed-address ``SequenceInfo`` buffers with the step's new tokens and pages;
        ``pad_to``: add padding sequences up to that many (``pad_rows``: one token at position 0 on
        a scratch page), for a CUDA graph captured for that batch size.

        A decode step of the same sequences as the step before (the common case) only advances
        the buffers (``SequenceInfo.advance_decode``): new token ids in, positions + 1."""
        layout = decode_layout(step, pad_to)
        if layout is not None and self.seq_info.layout_key is self._layout and layout == advanced(self._layout):
            tokens = [r.tokens[r.num_cached] for r, _ in step.items]
            self.seq_info.advance_decode(tokens + [0] * (layout[0] - len(tokens)), len(tokens), layout)
            self.advanced_steps += 1
        else:
            self._set_step_fully(step, sched, pad_to, layout)
        self._layout = layout

    def pad_rows(self) -> Tuple[int, int]:
        """(page, slot) of padding sequences; only runners that keep a scratch page pad."""
        raise ValueError(f"{type(self).__name__} keeps no scratch page to pad a batch with")

    def _set_step_fully(self, step: Step, sched: Scheduler, pad_to: Optional[int], layout: Any) -> None:
        tokens = [r.tokens[r.num_cached : r.num_cached + n] for r, n in step.items]
        fresh = [sched.slot(r) for r, _ in step.items if r.num_cached == 0]
        if fresh and self.slot_states:
            # a new sequence's state rows start at zero: the stateful ops already start from zero at
            # input_pos 0, but per-slot values that are inputs rather than state (the mRoPE delta) must
            # not keep the previous owner's value
            idx = torch.tensor(fresh, device=self.device)
            for t in self.slot_states:
                t.index_fill_(0, idx, 0)
        pos = [r.num_cached for r, _ in step.items]
        pages = [sched.pages(r) for r, _ in step.items]
        slots = [sched.slot(r) for r, _ in step.items]
        pad = (pad_to or 0) - len(step.items)
        if pad > 0:
            page, slot = self.pad_rows()
            tokens, pos, pages, slots = (
                tokens + [[0]] * pad,
                pos + [0] * pad,
                pages + [[page]] * pad,
                slots + [slot] * pad,
            )
        self.seq_info.set_batch(
            tokens,
            pos,
            pages,
            num_prefill=step.num_prefill,
            page_size=self.cfg.page_size,
            slots=slots,
            layout_key=layout,
        )

    def _inputs(self, **overrides: Any) -> List[Any]:
        """The module's positional inputs for the current step: metadata views, then caches
        (``overrides``: other values for some of them by name). The views of a step shape are the
        same every time (fixed buffers), so each shape's list is built once."""
        info = self.seq_info
        key = (info.num_seqs, info.num_tokens, info.num_prefill)
        if not overrides and key in self._input_lists:
            return self._input_lists[key]
        values: Dict[str, Any] = {**info.inputs(), **self.caches, **overrides}
        inputs = [values[n] for n in self.input_names]
        if not overrides:
            self._input_lists[key] = inputs
        return inputs

    def forward(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Logits of the step's flattened tokens [1, T, V], or of each sequence's last token
        [1, B, V] for a module that gathers before the LM head."""
        self.set_step(step, sched)
        with torch.no_grad(), self.planned():
            return self.fn(*self._inputs())

    def step(self, step: Step, sched: Scheduler) -> torch.Tensor:
        """Logits of each sequence's last new token: [B, V]."""
        return self.last_token_logits(self.forward(step, sched), len(step.items))

    def last_token_logits(self, logits: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """[B, V] of the module's output for the step in ``seq_info``: its rows of each sequence's
        last new token ([: B]: a CUDA-graph runner pads the batch with scratch rows nobody reads)."""
        if self.gathers_last_tokens:
            return logits[0, :num_seqs]
        return logits[0].index_select(0, self.seq_info.last_token_index)[:num_seqs]


def decode_layout(step: Step, pad_to: Optional[int] = None) -> Optional[Any]:
    """A decode-only step's layout: (padded size, ((request id, tokens cached), ...)); None for a
    step with prefill. Two steps continue each other when ``advanced`` of the first is the second."""
    if step.num_prefill:
        return None
    return (pad_to or len(step.items), tuple((id(r), r.num_cached) for r, _ in step.items))


def advanced(layout: Optional[Any]) -> Optional[Any]:
    """The layout of the next decode step of the same sequences (each one token further)."""
    if layout is None:
        return None
    size, seqs = layout
    return (size, tuple((rid, n + 1) for rid, n in seqs))


class UncachedRunner:
    """Re-forwards every sequence's whole history each step (no cache stage in the pipeline)."""

    cache_mode = "uncached (full re-forward)"

    def __init__(self, module: torch.nn.Module, cfg: KVCacheConfig, device: torch.device | str = "cpu"):
        self.module, self.cfg, self.device = module, cfg, torch.device(device)

    def scheduler(self) -> Scheduler:
        return Scheduler(self.cfg, PageAllocator(self.cfg.num_pages))

    def step(self, step: Step, sched: Scheduler) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            for r, n in step.items:
                ids = torch.tensor(r.tokens[: r.num_cached + n], device=self.device)[None]
                pos = torch.arange(ids.shape[1], device=self.device)[None]
                rows.append(self.module(ids, pos)[0, -1])
        return torch.stack(rows)


# The cache check's two sequences: their lengths (different, so a layer that mixes the batch's
# sequences shows too) and the seed of their token ids.
CACHE_CHECK_LENS = (6, 3)
CACHE_CHECK_SEED = 0


def cache_check_tolerance(*dtypes: torch.dtype, activation_steps: Sequence[float] = ()) -> float:
    """How far a cached module's split run may drift from its single prefill (``check_cache_carries_past``):
    the square root of the coarsest rounding step in play, the model's and the caches' dtypes -- 1e-3
    at the least: float32 1e-3, float16 0.031, bfloat16 0.088, an 8-bit float cache 0.35 -- and twice
    that for the grids the graph's quantized ops round activations to (``activation_steps``), at most
    0.71: int8 activations 0.18, FP8 and FP4 activations 0.71. A layer that sees no past moves the
    logits by about their own spread (ratio ~1).

    Why twice for activation grids: a value that lands near a rounding boundary goes either way with
    the last bit of the sums before it, so the drift depends on the summation order of every kernel
    upstream -- smollm2 Q4_1 with int8 activations, six check seeds each: 0.027-0.081 on the AVX-512
    build, 0.029-0.097 on the AVX2 build (above the grid's square root, 0.088)."""
    eps = max([torch.finfo(d).eps for d in dtypes if d.is_floating_point], default=0.0)
    tol = max(1e-3, eps**0.5)
    if activation_steps:
        tol = max(tol, min(0.71, 2 * max(activation_steps) ** 0.5))
    return tol


def activation_steps(module: torch.nn.Module) -> List[float]:
    """The rounding steps of the activation quantization the ops of ``module``'s graphs do
    (``define_op(..., activation_rounding=)``): a decode step's inputs differ from the prefill's by
    float32 rounding, and such an op turns that into a whole grid step now and then."""
    steps = set()
    for gm in module.modules():
        graph = getattr(gm, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is not None and schema.name.startswith("workbench::"):
                step = activation_rounding(schema.name.split("::", 1)[1])
                if step is not None:
                    steps.add(step)
    return sorted(steps)


def _check_forwards(module: torch.nn.Module, cfg: KVCacheConfig, device: torch.device, steps) -> torch.Tensor:
    """Last-token logits [B, V] after running ``steps`` ((tokens, input_pos, num_prefill) each) through
    ``module`` on scratch caches of ``cfg``'s specs sized for the check (never the real caches)."""
    runner = CachedRunner(module, allocate_caches(cfg, device), cfg, device)
    per_seq = cfg.pages_for(max(CACHE_CHECK_LENS))
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(CACHE_CHECK_LENS))]
    logits = None
    for tokens, input_pos, num_prefill in steps:
        runner.seq_info.set_batch(tokens, input_pos, pages, num_prefill=num_prefill, page_size=cfg.page_size)
        with torch.no_grad(), runner.planned():
            logits = runner.module(*runner._inputs())
    assert logits is not None
    return runner.last_token_logits(logits, len(CACHE_CHECK_LENS)).float()


def cache_check_ratio(module: torch.nn.Module, cfg: KVCacheConfig, device: torch.device, vocab_size: int) -> float:
    """How far the last tokens' logits of two seeded sequences move between one prefill and a prefill
    of all but the last token then a decode step of it, on scratch caches of ``cfg``'s specs: the RMS
    of the difference over the RMS spread of the logits (0 for caches that carry the past, up to
    rounding). Raises whatever the module raises."""
    g = torch.Generator().manual_seed(CACHE_CHECK_SEED)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in CACHE_CHECK_LENS]
    b, longest = len(prompts), max(CACHE_CHECK_LENS)
    scratch = KVCacheConfig.sized(
        page_size=cfg.page_size,
        num_pages=b * cfg.pages_for(longest),
        dtype=cfg.dtype,
        max_batch_size=b,
        max_seq_len=longest,
        max_num_tokens=sum(CACHE_CHECK_LENS),
        specs=cfg.specs,
    )
    one = _check_forwards(module, scratch, device, [(prompts, [0] * b, b)])
    split = [([p[:-1] for p in prompts], [0] * b, b), ([[p[-1]] for p in prompts], [len(p) - 1 for p in prompts], 0)]
    two = _check_forwards(module, scratch, device, split)
    spread = (one - one.mean(-1, keepdim=True)).pow(2).mean().sqrt().clamp_min(1e-30)
    return ((one - two).pow(2).mean().sqrt() / spread).item()


def check_cache_carries_past(
    module: torch.nn.Module, cfg: KVCacheConfig, device: torch.device, vocab_size: int, model_dtype: torch.dtype
) -> None:
    """Refuse (``InputError``) a cached module whose caches do not carry the past.

    A cached graph feeds each step only the new tokens: every layer that mixes positions must read
    the earlier ones from a cache. One that does not -- an attention or recurrent layer whose cache
    insert was disabled, a mixer class no pattern canonicalized -- still runs, and generates wrong
    tokens under a runner that says "paged KV cache". So two seeded sequences run twice on scratch
    caches (``cache_check_ratio``): as one prefill, and as a prefill of all but the last token then a
    decode step of it. With working caches the last tokens' logits agree to rounding; a layer without
    a cache sees only the decode token and moves them by a good part of their spread. Three forwards
    of a few tokens.
    """
    what = "one prefill vs a prefill then a decode step, two short sequences on scratch caches"
    try:
        ratio = cache_check_ratio(module, cfg, device, vocab_size)
    except Exception as e:  # noqa: BLE001 - any failure here is a graph the runner cannot serve
        raise InputError(
            f"generation refused: the cached model fails the cache check ({what}): "
            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from e
    tol = cache_check_tolerance(model_dtype, cfg.dtype, activation_steps=activation_steps(module))
    if not ratio <= tol:  # NaN fails too
        raise InputError(
            f"generation refused: the cached model's decode step disagrees with its own prefill ({what}: "
            f"logits differ by {ratio:.2g} of their spread, tolerance {tol:.2g}), so its caches do not "
            "carry the past: some layer that mixes positions has no cache (a cache insert disabled in the "
            "cache_init stage, or a sequence mixer the pattern matcher did not canonicalize) and would see "
            "only each step's new tokens. Enable the cache inserts, or disable every one of them to "
            "generate uncached (full re-forward)"
        )


class CacheView(Protocol):
    """The caches a finished pipeline allocated (``PipelineContext.cache``)."""

    config: Optional[KVCacheConfig]

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...  # read-only: a dict attribute satisfies it


class RunnerSource(Protocol):
    """What ``runner_for`` reads of a finished pipeline (a ``PipelineContext`` is one; the runtime
    never imports the pipeline): the compiled runner if one was built, the caches, the limits, and
    where and in which dtype the model runs."""

    runner: Optional["CachedRunner"]

    @property
    def cache(self) -> CacheView: ...  # read-only: a CacheState attribute satisfies it

    limits: RuntimeLimits
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int: ...  # read-only: a property of the context


def plain_step(module: torch.nn.Module, device: torch.device) -> Tuple[Callable[..., Any], str]:
    """What the plain runner calls for a step, and what that is in words: on CPU the graph as a C++
    step program (no Python per node, ``step_program.py``), else -- or where the graph has a node
    the program cannot express -- the lean Python copy (``lean_graph.py``). Both run the graph's
    operators with the same arguments in the same order: the same results bit for bit."""
    why = "runs on CUDA: its own runners (CUDA graphs, torch.compile) replace the Python step"
    if torch.device(device).type == "cpu":
        program, why = build_step_program(module)
        if program is not None:
            return program, f"C++ step program ({program.num_calls} calls a step)"
    logger.info("the plain runner steps the graph from Python: %s", why)
    return lean_copy(module), f"Python graph ({why})"


def runner_for(module: torch.nn.Module, ctx: RunnerSource):
    """The runner for a pipeline's final module and its context (``RunnerSource``).

    ``compile_model`` leaves its runner (torch.compile, CUDA graphs) in ``ctx.runner``; it is used
    when it was built for this very module, otherwise the plain runner is built here. A cached
    module must pass ``check_cache_carries_past`` first (an ``InputError`` otherwise): no runner
    claims a cache the graph does not have.
    """
    cached = is_cached_module(module)
    if cached:
        cfg = ctx.cache.config
        if cfg is None:
            raise InputError(
                "generation refused: the model takes cache inputs but no KV cache was allocated: enable "
                "initialize_cache (and resize_kv_cache) in the cache_init stage"
            )
        check_cache_carries_past(module, cfg, ctx.device, ctx.vocab_size, ctx.dtype)
    built = ctx.runner
    if built is not None:
        if built.module is module:
            return built
        logger.warning("the compiled runner was built for another module: running %s eagerly", type(module).__name__)
    if cached:
        assert cfg is not None
        runner = CachedRunner(module, ctx.cache.tensors, cfg, ctx.device)
        runner.fn, runner.step_form = plain_step(module, ctx.device)
        return runner
    logger.warning("no cache stage ran: generating without a KV cache (every step re-runs the whole sequence)")
    lim = dataclasses.replace(ctx.limits, max_num_tokens=ctx.limits.max_batch_size * ctx.limits.max_seq_len)
    cfg = KVCacheConfig(lim, lim.max_batch_size * -(-lim.max_seq_len // lim.page_size), ctx.dtype)
    return UncachedRunner(module, cfg, ctx.device)


__all__ = [
    "CachedRunner",
    "UncachedRunner",
    "RunnerSource",
    "CacheView",
    "runner_for",
    "check_cache_carries_past",
    "cache_check_ratio",
    "cache_check_tolerance",
    "activation_steps",
]
