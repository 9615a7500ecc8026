"""Check one registry entry end to end: load, export + the whole pipeline step by step, cached greedy
generation in a continuous batch, compared token for token with HF ``generate`` on the same weights.

What one check does (``check_entry``), and why:

* load the model; for ``tiny:`` random Mamba-2 families re-draw the mixers like a trained checkpoint
  (``RegistryEntry.redraw_ssm``): HF's random init leaves their state below fp32 resolution, so a state
  cache that lost it would still give HF's tokens;
* HF's greedy tokens for every prompt, each prompt alone, *before* the pipeline runs: the pipeline's
  graph shares the eager model's weight storage, and a transform that wrote into it would otherwise
  move the reference along with the result;
* the pipeline one ``step()`` at a time: a ``TransformError`` names the stage and transform that stopped
  it (the earlier snapshots are kept, so the worst probe so far is still reported);
* ``generate`` with ``max_batch_size`` 2 and prompts of different lengths: later prompts are admitted
  while earlier ones decode (mixed prefill + decode steps) and reuse finished sequences' pages and state
  slots;
* the oracle's strength: the fewest distinct tokens among HF's greedy continuations of the prompts.
  A continuation that repeats a token or two (a random model whose layers barely move the residual
  stream) would also "match" with broken attention or a broken cache, so it fails the row;
* tokens that differ are explained at the first differing step (``divergence.py``): HF's own cache
  changing HF's answer, workbench's cache, a near-tie, or the graph;
* pass = the pipeline reached its end, no attention was left without a cache, the runner used its
  caches, every prompt's tokens equal HF's, and HF's tokens make a strong oracle.

``check_entry`` never raises for a model's failure (only ``KeyboardInterrupt`` and the like escape):
each failure is a ``CheckResult`` whose fields say where and why.

The row itself (``CheckSettings``, ``CheckResult``, the prompts, HF's greedy tokens and the measures) is
``check_row.py``'s, shared with ``check_sharded.py`` (an entry with ``world_size > 1``); this module
re-exports those names, with the two steps around the pipeline that both paths take alike (HF's
reference tokens, the generation compared with them): ``reference_tokens`` and ``generate_and_record``.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, List, Optional, Sequence

import torch

# check_row's names are re-exported here (``X as X``, and ``__all__``): tests and reports import them from check
from . import check_row
from .check_row import CACHE_KINDS as CACHE_KINDS
from .check_row import UNCACHED_RUNNER as UNCACHED_RUNNER
from .check_row import (
    CheckResult,
    CheckSettings,
    check_prompts,
    first_line,
    generate_and_record,
    load_entry,
    record_pipeline,
    reference_tokens,
)
from .check_row import compare_tokens as compare_tokens
from .check_row import hf_greedy as hf_greedy
from .check_row import inserted_cache_kinds as inserted_cache_kinds
from .check_row import oracle_strength as oracle_strength
from .check_row import record_generation as record_generation
from .check_row import uncached_attention_left as uncached_attention_left
from .check_row import worst_probe as worst_probe
from .divergence import explain_divergence
from .memory_estimate import memory_refusal
from .registry import RegistryEntry

DEFAULT_SETTINGS = CheckSettings()  # frozen: one shared default for check_entry and check_registry


# ---------------------------------------------------------------------------------------------- one entry
def check_entry(entry: RegistryEntry, settings: CheckSettings = DEFAULT_SETTINGS) -> CheckResult:
    """Run one entry (see the module docstring); failures come back as the result's fields."""
    t0 = time.perf_counter()
    result = CheckResult(key=entry.key, model=entry.name, min_oracle_tokens=settings.min_oracle_tokens)
    try:
        _run(entry, settings, result)
    except Exception as e:  # noqa: BLE001 - a bug anywhere is this entry's row, not the end of the check
        result.stopped_at = result.stopped_at or "internal error"
        result.error = result.error or first_line(e)
    result.seconds = time.perf_counter() - t0
    return result


def _run(entry: RegistryEntry, settings: CheckSettings, result: CheckResult) -> None:
    from ..api import Workbench
    from ..models.tiny_families.ssm import checkpoint_like_ssm_weights
    from ..pipeline.config import ConfigError
    from ..pipeline.interface import TransformError

    try:
        refusal, result.memory = memory_refusal(entry.name, torch.device("cpu"), copies=entry.world_size)
    except Exception as e:  # noqa: BLE001 - a spec that does not resolve fails at load, with its own message
        refusal, result.memory = None, f"not estimated ({first_line(e, 120)})"
    if refusal:
        result.stopped_at, result.error = "memory", refusal
        return
    if entry.world_size > 1:  # the same row, the pipeline on N ranks (check_sharded.py)
        from .check_sharded import run_sharded

        return run_sharded(entry, settings, result)
    loaded = load_entry(entry, result)
    if loaded is None:
        return
    if entry.redraw_ssm:
        checkpoint_like_ssm_weights(loaded.model, seed=1)  # a no-op without Mamba-2 mixers
    try:
        wb = Workbench(
            loaded, yaml_extra=entry.yaml_extra, overrides=entry.overrides, max_batch_size=settings.max_batch_size
        )
    except ConfigError as e:
        result.stopped_at, result.error = "config", first_line(e)
        return
    result.transforms_total = len(wb.entries)
    prompts = check_prompts(wb.ctx.vocab_size, settings.prompt_lens, settings.prompt_seed)
    want = reference_tokens(loaded.model, prompts, settings, result)
    if want is None:
        return
    try:
        while not wb.done:
            step_key, step_stage = wb.entries[wb.position].key, wb.entries[wb.position].config.stage.value
            wb.step()
    except TransformError as e:
        result.stopped_at, result.error = f"{e.stage.value}/{e.key}", first_line(e.cause)
    except Exception as e:  # noqa: BLE001 - the stepper itself failed around this transform
        result.stopped_at, result.error = f"{step_stage}/{step_key}", first_line(e)
    finally:
        record_pipeline(result, wb.snapshots, [e.config.stage.value for e in wb.entries])
    if result.stopped_at:
        return
    out = generate_and_record(wb, prompts, want, loaded.tokenizer, settings, result)
    if out is not None and result.tokens_equal is False:
        result.divergence = explain(wb, loaded.model, prompts, [r.token_ids for r in out.results], want)


def explain(wb, hf_model: torch.nn.Module, prompts, got, want) -> str:
    """The divergence verdict's line (``divergence.py``); what stopped it, if it could not be made."""
    try:
        found = explain_divergence(wb, hf_model, prompts, got, want)
    except Exception as e:  # noqa: BLE001 - the row keeps its token comparison; the verdict is extra
        return f"not explained ({first_line(e, 160)})"
    return found.line if found is not None else ""


# ---------------------------------------------------------------------------------------------- many
def check_registry(
    entries: Sequence[RegistryEntry],
    settings: CheckSettings = DEFAULT_SETTINGS,
    on_result: Optional[Callable[[CheckResult, int, int], None]] = None,
) -> List[CheckResult]:
    """``check_entry`` for each entry in order; ``on_result(result, i, n)`` after each (progress, a report
    rewritten as rows arrive). Each entry's models and graphs are released before the next starts."""
    results: List[CheckResult] = []
    for i, entry in enumerate(entries):
        results.append(check_entry(entry, settings))
        gc.collect()
        if on_result is not None:
            on_result(results[-1], i, len(entries))
    return results


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 when every row passes (no rows: nothing failed), 1 otherwise."""
    return 0 if all(r.passed for r in results) else 1


__all__ = [  # (check_row's names are re-exported: tests and reports import them from here)
    *(name for name in check_row.__all__ if name not in ("first_line", "load_entry")),
    "check_entry",
    "check_registry",
    "exit_code",
    "explain",
]
