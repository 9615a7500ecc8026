"""The cache check: does a cached module carry the past? (``check_cache_carries_past``)

A cached graph whose cache rewrite missed a layer (an attention spelling no matcher knew, a state op
left uncached) still runs and returns logits -- of a model that forgets. Before any runner claims a
cache, the module runs two sequences split into a prefill and later steps, and the last logits must
equal one prefill of the whole sequences to within the rounding the dtypes allow.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.fx as fx

from ..errors import InputError
from ..ops.library import activation_rounding
from .kv_cache import KVCacheConfig, allocate_caches
from .runner import CachedRunner

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


__all__ = ["check_cache_carries_past", "cache_check_ratio", "cache_check_tolerance", "activation_steps"]
