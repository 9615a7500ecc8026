"""What ``workbench run`` prints around the pipeline: the table of transforms and the summary block.

On a plain model most of the 60 default transforms change nothing (no quantization config, no MoE,
no SSM, a CPU with no auxiliary streams): listing each as a row buries the ones that did the work.
The table shows the transforms that did something -- matched, added or removed nodes, moved
memory, failed -- plus the milestones (export, weight load, compile), and folds the rest into one
line per stage; ``verbose`` lists every row and every note.

The summary block ends the run with what a user asks first: the answer, where and how it ran and
why, how fast (time to first token, decode tokens/s), how much memory (weights, KV cache, peak RSS),
and where the time went (load, transforms, numerics probes).
"""

from __future__ import annotations

import resource
from typing import Any, Iterable, List, Optional, Sequence

MILESTONES = ("export_to_gm", "load_weights", "compile_model")  # always a row: the story's landmarks


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    return f"{n / 2**20:+.1f}MiB"


def _fmt_num(snap) -> str:
    n = snap.numerics
    if n is None:
        return "off"
    if not n.ok:
        return "n/a"
    return f"rmse {n.rmse_ratio:.1e} max {n.max_abs:.1e} top1 {n.top1_agreement:.0%}"


def changed_nothing(snap, prev_nodes: int) -> bool:
    """A transform that left this model as it was: no match, same node count, no memory moved, no
    warning, not failed (disabled ones included) -- and not one of the milestones."""
    return (
        snap.key not in MILESTONES
        and snap.info.num_matches == 0
        and snap.num_nodes == prev_nodes
        and snap.mem_delta == 0
        and not snap.mem_warning
        and snap.status in ("done", "skipped")
    )


def _fold_line(stage: str, keys: List[str], width: int) -> str:
    names = ", ".join(keys)
    text = f"{len(keys)} changed nothing on this model: {names}"
    if len(text) > width:
        text = text[: width - 1].rsplit(", ", 1)[0] + ", ..."
    return f"    {stage}  ({text})"


def format_table(stepper, verbose: bool = False, keep: Iterable[str] = ()) -> str:
    """Fixed-width per-transform table: stage, key, status, matches, time, nodes, memory, numerics.
    Without ``verbose`` the transforms that changed nothing are folded into one line per stage,
    except those in ``keep`` (the ones the user configured: their row confirms what they asked)."""
    keep = set(keep)
    header = ("#", "stage", "transform", "status", "match", "time", "nodes", "Δnodes", "Δmem", "numerics")
    rows: List[Any] = []  # a tuple of cells, or a fold line (str)
    folded: List[str] = []
    prev, shown = 0, []
    snaps = list(stepper.snapshots)
    for i, s in enumerate(snaps):
        quiet = not verbose and s.key not in keep and changed_nothing(s, prev)
        if quiet:
            folded.append(s.key)
        else:
            shown.append(s)
            rows.append(
                (
                    str(s.index),
                    s.stage.value,
                    s.key,
                    s.status,
                    str(s.info.num_matches),
                    f"{s.times.total:.3f}s",
                    str(s.num_nodes),
                    f"{s.num_nodes - prev:+d}",
                    _fmt_bytes(s.mem_delta) + (" !" if s.mem_warning else ""),
                    _fmt_num(s),
                )
            )
        prev = s.num_nodes
        stage_ends = i + 1 == len(snaps) or snaps[i + 1].stage != s.stage
        if stage_ends and folded:
            rows.append(_fold_line(s.stage.value, folded, 110))
            folded = []
    cells = [header] + [r for r in rows if isinstance(r, tuple)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) if isinstance(r, tuple) else r for r in rows]
    notes = [f"  ! {s.key}: {s.mem_warning}" for s in stepper.snapshots if s.mem_warning]
    notes += [
        f"  {s.key}: {s.info.skip_reason or s.info.details['summary']}"
        for s in (stepper.snapshots if verbose else shown)
        if (s.info.skip_reason and s.info.skip_reason != "disabled") or s.info.details.get("summary")
    ]
    if not verbose and len(shown) < len(stepper.snapshots):
        notes.append(f"  ({len(stepper.snapshots) - len(shown)} transforms folded; --verbose lists every row and note)")
    return "\n".join(out + notes)


def pipeline_line(stepper, wall_s: Optional[float]) -> str:
    """``pipeline: N transforms in W s`` -- the wall time, with the share of the transforms
    themselves and of the rest (numerics probes, snapshots) when the wall time was measured."""
    n, transforms_s = len(stepper.snapshots), stepper.total_time()
    if wall_s is None:
        return f"pipeline: {n} transforms in {transforms_s:.2f}s"
    probed = [s.numerics for s in stepper.snapshots if s.numerics is not None and not s.numerics.carried_from]
    cached = sum(1 for n in probed if n.from_cache)
    rest = max(0.0, wall_s - transforms_s)
    reused = f" ({cached} read from the probe cache)" if cached else ""
    what = f"{len(probed)} numerics probes{reused} and the snapshots" if probed else "snapshots and bookkeeping"
    return f"pipeline: {n} transforms in {wall_s:.2f}s wall: the transforms {transforms_s:.2f}s, {what} {rest:.2f}s"


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def summary_block(
    *,
    answer: Optional[str],
    backends: str,
    stats: Any,
    weights_bytes: Optional[int],
    cache_bytes: Optional[int],
    load_s: Optional[float],
    pipeline: str,
    compile_cost: Optional[str] = None,
) -> str:
    """The last lines of a run: answer, backends and why, speed, memory, time, and what
    torch.compile cost when it ran (``runtime.compile_cost.compile_line``)."""
    lines = ["summary:"]
    if answer is not None:
        lines.append(f"  answer    {answer}")
    lines.append(f"  ran       {backends}")
    if stats is not None:
        ttft = stats.time_to_first_token_s
        speed = [f"first token {ttft * 1e3:.0f} ms" if ttft is not None else None]
        speed.append(f"decode {stats.decode_tokens_per_s:.1f} tok/s")
        lines.append(f"  speed     {', '.join(s for s in speed if s)} ({stats.generated_tokens} tokens)")
    memory: Sequence[Optional[str]] = (
        f"weights {_mib(weights_bytes)}" if weights_bytes is not None else None,
        f"KV cache {_mib(cache_bytes)}" if cache_bytes is not None else None,
        f"peak RSS {_mib(peak_rss_bytes())}",
    )
    lines.append(f"  memory    {', '.join(m for m in memory if m)}")
    time_line = pipeline.removeprefix("pipeline: ")
    lines.append(f"  time      {f'load {load_s:.1f}s; ' if load_s is not None else ''}pipeline {time_line}")
    if compile_cost is not None:
        lines.append(f"  compile   {compile_cost}")
    return "\n".join(lines)


__all__ = ["MILESTONES", "changed_nothing", "format_table", "pipeline_line", "peak_rss_bytes", "summary_block"]
