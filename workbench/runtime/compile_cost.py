"""What torch.compile cost this run, and whether it can be reused: the ``compile`` line of
``workbench run``'s summary.

Inductor compiles in two places here: ``compile_model`` (the static batch-1 decode graph, and
Dynamo's trace of the runner's step) and the first call of each new shape (a prefill's graph), which
lands in the first token's time. Both write Inductor's FX-graph cache
(``$TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_$USER``), so a second run of the same
model and config loads compiled code instead of generating and building it: on smollm2 (CPU,
2026-11-27) 148.7 s in ``compile_model`` and 47.8 s to the first token cold, 7.7 s and 2.4 s warm.
The numbers come from torch's own counters, read without importing anything: a run that never
compiled has none and prints no line.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class InductorState:
    """Torch's cumulative compile counters at one moment of this process."""

    dynamo_s: float  # seconds Dynamo spent compiling frames (Inductor's work for them included)
    hits: int  # FX-graph cache hits: compiled code loaded from disk
    misses: int  # FX-graph cache misses: code generated and built, then stored


def inductor_state() -> Optional[InductorState]:
    """The counters now, or None when torch's compiler was never imported (nothing compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    inductor = utils.counters.get("inductor", {})
    times = utils.compilation_time_metrics.get("_compile.compile_inner", [])
    return InductorState(
        dynamo_s=float(sum(times)),
        hits=int(inductor.get("fxgraph_cache_hit", 0)),
        misses=int(inductor.get("fxgraph_cache_miss", 0)),
    )


def inductor_cache_dir() -> str:
    """Where Inductor keeps its cache (asked of Inductor when it is loaded, as it compiled)."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is not None:
        return str(utils.cache_dir())
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "$TORCHINDUCTOR_CACHE_DIR")


def compile_line(
    compile_model_s: Optional[float],
    at_start: Optional[InductorState],
    before_generate: Optional[InductorState],
    after: Optional[InductorState],
) -> Optional[str]:
    """``torch-compile: 148.7 s in compile_model, 47.1 s on first use; Inductor cache 0 hits, 9
    misses (cold: ...)``, from the compile_model transform's time and the counters at the run's
    start, before generation and after it; None when this run compiled nothing.

    The counters are cumulative per process: a notebook or a test worker that compiled before this
    run still has them, so only what changed since ``at_start`` is this run's."""
    if after is None:
        return None
    base = at_start or InductorState(0.0, 0, 0)
    hits, misses = after.hits - base.hits, after.misses - base.misses
    if hits + misses == 0:
        return None
    first_use = after.dynamo_s - (before_generate.dynamo_s if before_generate is not None else base.dynamo_s)
    parts = []
    if compile_model_s is not None:
        parts.append(f"{compile_model_s:.1f} s in compile_model")
    parts.append(f"{first_use:.1f} s on first use (new shapes)")
    if misses == 0:
        reuse = "warm: compiled code loaded, not built"
    elif hits == 0:
        reuse = f"cold: the next run of this model and config reuses {inductor_cache_dir()}"
    else:
        reuse = f"partly warm: the rest is now stored in {inductor_cache_dir()}"
    return f"{', '.join(parts)}; Inductor cache {hits} hits, {misses} misses ({reuse})"


__all__ = ["InductorState", "compile_line", "inductor_cache_dir", "inductor_state"]
