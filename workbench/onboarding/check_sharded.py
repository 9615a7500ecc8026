"""``workbench check`` for a registry entry with ``world_size > 1``: the same row as ``check.check_entry``
(HF's greedy tokens first, the whole pipeline step by step, cached generation compared token for
token), with the pipeline run on ``world_size`` ranks (``Workbench(..., world_size=N)``: gloo on CPU).

The parent loads the model once for HF's reference tokens; every rank loads its own copy from the
spec (same seed, so the same weights; ``custom_models`` and the pipeline YAML travel as options).
The Mamba-2 re-draw (``RegistryEntry.redraw_ssm``) changes the parent's copy only, so an entry that
needs it is refused here with that reason instead of comparing different weights.
"""

from __future__ import annotations

from . import check_row as row
from .check_row import CheckResult, CheckSettings
from .registry import RegistryEntry


def run_sharded(entry: RegistryEntry, settings: CheckSettings, result: CheckResult) -> None:
    """Fill ``result`` for ``entry`` run on ``entry.world_size`` ranks; failures become its fields.
    The prompts and the row's measures are ``check_row``'s, HF's reference and the generation step
    ``check_row``'s (``reference_tokens``, ``generate_and_record``), as for one process."""
    from ..api import Workbench
    from ..parallel.sharded import ShardedWorkbench
    from ..pipeline.config import ConfigError

    loaded = row.load_entry(entry, result)
    if loaded is None:
        return
    if entry.redraw_ssm and any("mamba" in type(m).__name__.lower() for m in loaded.model.modules()):
        result.stopped_at = "config"
        result.error = (
            "world_size > 1 with re-drawn Mamba-2 mixers: the ranks load their own weights (set weights: as_loaded)"
        )
        return
    prompts = row.check_prompts(loaded.config.vocab_size, settings.prompt_lens, settings.prompt_seed)
    want = row.reference_tokens(loaded.model, prompts, settings, result)
    if want is None:
        return
    tokenizer = loaded.tokenizer
    del loaded
    try:
        wb = ShardedWorkbench(
            entry.name,
            world_size=entry.world_size,
            workbench_class=Workbench,
            dtype="float32",
            gguf_weights=entry.gguf_weights,
            custom_models=entry.custom_models,
            yaml_extra=entry.yaml_extra,
            overrides=entry.overrides,
            max_batch_size=settings.max_batch_size,
        )
    except ConfigError as e:
        result.stopped_at, result.error = "config", row.first_line(e)
        return
    try:
        step_key = "start"
        try:
            while not wb.done:
                step_key = wb.keys[wb.position] if wb.position < len(wb.keys) else step_key
                wb.step()
        except Exception as e:  # noqa: BLE001 - a rank's failure names the transform it was in
            result.stopped_at, result.error = f"sharded/{step_key}", row.first_line(e)
        finally:
            snaps = list(wb.snapshots)  # rank 0's; the ranks' stages are the single pipeline's
            row.record_pipeline(result, snaps, [s.stage.value for s in snaps], total=len(wb.keys))
        if result.stopped_at:
            return
        row.generate_and_record(wb, prompts, want, tokenizer, settings, result)
    finally:
        wb.close()


__all__ = ["run_sharded"]
