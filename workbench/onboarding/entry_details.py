"""What one ``workbench check`` row found beyond its table cells (the report's per-entry section).

* **Prompt -> output**: the first prompts, the workbench's greedy continuation and HF's, as text
  where the model has a tokenizer, else as token ids;
* **Results**, as a tree: memory estimate, load, the pipeline per stage (transforms that ran, made
  matches, failed under ``skip_on_error``; the worst numerics probe of the stage), caches, and the
  comparison with HF;
* **Limitations**: what the run found short of a full pass -- also on a row that passes (a transform
  skipped on error, a probe that could not run, an attention node left uncached, ...).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .check import CheckResult

SAMPLES = 2  # prompts shown per entry
MAX_IDS = 12  # token ids shown per sample when there is no tokenizer


@dataclass(frozen=True)
class StageResult:
    """One pipeline stage of one entry."""

    stage: str
    ran: int  # transforms that ran (enabled or not: each leaves a snapshot)
    total: int  # transforms of the stage in the pipeline
    matched: int  # with at least one match
    failed: Tuple[str, ...]  # transforms that failed and were skipped (skip_on_error)
    worst_rmse: Optional[float]  # worst probe RMSE ratio after a transform of the stage

    @property
    def status(self) -> str:
        if self.failed:
            return "failed: " + ", ".join(self.failed)
        return "ok" if self.ran == self.total else f"stopped after {self.ran} of {self.total}"


def stage_results(stages_of_entries: Sequence[str], snapshots: Iterable) -> List[StageResult]:
    """Per stage, in pipeline order: ``stages_of_entries`` is the stage of each pipeline entry."""
    snaps = list(snapshots)
    out = []
    for stage in dict.fromkeys(stages_of_entries):
        mine = [s for s in snaps if s.stage.value == stage]
        probes = [s.numerics.rmse_ratio for s in mine if s.numerics is not None and s.numerics.ok]
        out.append(
            StageResult(
                stage=stage,
                ran=len(mine),
                total=sum(1 for st in stages_of_entries if st == stage),
                matched=sum(1 for s in mine if s.status == "done" and s.info.num_matches > 0),
                failed=tuple(s.key for s in mine if s.status == "failed"),
                worst_rmse=max(probes) if probes else None,
            )
        )
    return out


def _show(ids: Sequence[int], tokenizer) -> str:
    if tokenizer is not None:
        return repr(tokenizer.decode(list(ids)))
    shown = ", ".join(map(str, list(ids)[:MAX_IDS]))
    return f"[{shown}{', ...' if len(ids) > MAX_IDS else ''}] ({len(ids)} ids)"


def samples(
    prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]], want: Sequence[Sequence[int]], tokenizer
) -> List[Tuple[str, str, str]]:
    """(prompt, workbench output, HF output) of the first ``SAMPLES`` prompts, rendered."""
    return [
        (_show(p, tokenizer), _show(g, tokenizer), _show(w, tokenizer))
        for p, g, w in list(zip(prompts, got, want))[:SAMPLES]
    ]


def limitations(r: "CheckResult") -> List[str]:
    """What the row found short of a full pass, one line each (empty: none found)."""
    found = []
    if r.stopped_at:
        found.append(f"stopped at {r.stopped_at}: {r.error}")
    found += [f"{key} failed and was skipped (skip_on_error)" for key in r.skipped_on_error]
    found += [f"attention node {n} has no KV cache: {why}" for n, why in r.uncached_attention.items()]
    if r.probe_errors:
        found.append(f"{r.probe_errors} numerics probe(s) could not run")
    if r.runner_cache.startswith("uncached"):
        found.append("generation ran uncached (the whole sequence re-run every step)")
    if r.tokens_equal is False:
        found.append(f"tokens differ from HF: {r.tokens}")
    if r.weak_oracle:
        found.append(f"weak oracle: {r.oracle_tokens} distinct HF tokens for some prompt (< {r.min_oracle_tokens})")
    return found


def _tree(r: "CheckResult") -> List[Tuple[int, str]]:
    """(depth, line) of the results tree."""
    lines = [
        (0, f"memory: {r.memory or 'not estimated'}"),
        (0, "load: " + ("failed" if r.stopped_at == "load" else "ok")),
    ]
    if r.stages:
        lines.append((0, f"pipeline: {r.transforms_run} of {r.transforms_total} transforms"))
        for s in r.stages:
            probe = "" if s.worst_rmse is None else f", worst probe {s.worst_rmse:.1e}"
            lines.append((1, f"{s.stage}: {s.status} ({s.ran} ran, {s.matched} matched{probe})"))
    if r.cache_kinds or r.runner_cache:
        lines.append((0, f"caches: {', '.join(r.cache_kinds) or 'none'}; runner: {r.runner_cache or '-'}"))
    if r.tokens_equal is not None:
        lines.append((0, f"tokens equal HF: {r.tokens}"))
    if r.oracle_tokens is not None:
        lines.append((0, f"oracle: {r.oracle_tokens} distinct HF tokens (at least {r.min_oracle_tokens} needed)"))
    return lines


def details_markdown(r: "CheckResult") -> str:
    out = [f"### {r.key} ({r.model}): {'pass' if r.passed else 'FAIL: ' + r.failure}", ""]
    if r.samples:
        out += ["Prompt -> output (workbench | HF):", ""]
        out += [f"- {p} -> {g} | {w}" for p, g, w in r.samples]
        out.append("")
    out += ["Results:", ""] + [f"{'  ' * d}- {line}" for d, line in _tree(r)] + [""]
    found = limitations(r)
    out += ["Limitations: " + ("none found" if not found else ""), ""] + [f"- {x}" for x in found]
    return "\n".join(out).rstrip() + "\n"


def details_html(r: "CheckResult") -> str:
    e = html.escape

    def ul(items: List[str]) -> str:
        return "<ul>" + "".join(f"<li>{e(i)}</li>" for i in items) + "</ul>"

    tree, stack = "", 0
    for depth, line in _tree(r):
        tree += "<ul>" * max(0, depth - stack) + "</ul>" * max(0, stack - depth) + f"<li>{e(line)}</li>"
        stack = depth
    tree = "<ul>" + tree + "</ul>" * stack + "</ul>"
    found = limitations(r)
    sample = ul([f"{p} -> {g} | {w}" for p, g, w in r.samples]) if r.samples else ""
    status = "pass" if r.passed else "FAIL: " + r.failure
    return (
        f'<details class="{"pass" if r.passed else "fail"}"><summary>{e(r.key)} ({e(r.model)}): {e(status)}</summary>'
        + (f"<p>Prompt -&gt; output (workbench | HF):</p>{sample}" if sample else "")
        + f"<p>Results:</p>{tree}<p>Limitations:</p>"
        + (ul(found) if found else "<p>none found</p>")
        + "</details>"
    )


__all__ = ["StageResult", "details_html", "details_markdown", "limitations", "samples", "stage_results"]
