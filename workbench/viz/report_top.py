"""The top of the report page: the run's summary rows and the pipeline table, where the transforms
that changed nothing on this model (``run_summary.changed_nothing``) fold into one line per stage, as
in ``workbench run``'s table."""

from __future__ import annotations

import html
from typing import Any, List, Tuple

from ..pipeline.snapshot import Snapshot
from ..run_summary import changed_nothing
from .report_page import fmt_error, fmt_fraction, fmt_mib, fmt_seconds


def _e(x: Any) -> str:
    return html.escape(str(x))


def section_id(i: int) -> str:
    """The anchor of snapshot ``i``'s section."""
    return f"step-{i:02d}"


def step_link(s: Snapshot) -> str:
    return f'<a href="#{section_id(s.index)}">{_e(s.key)}</a>'


# ------------------------------------------------------------------------------ top of the page
def folded_flags(snaps: List[Snapshot]) -> List[bool]:
    """Per snapshot: did it change nothing on this model (``run_summary.changed_nothing``)."""
    flags, prev = [], 0
    for s in snaps:
        flags.append(changed_nothing(s, prev))
        prev = s.num_nodes
    return flags


_PIPELINE_HEAD = (
    ("#", ""),
    ("stage", ""),
    ("transform", ""),
    ("status", ""),
    ("matches", "num"),
    ("time", "num"),
    ("nodes", "num"),
    ("Δnodes", "num"),
    ("Δmem", "num"),
    ("rmse ratio", "num"),
    ("max abs", "num"),
    ("top1", "num"),
    ("note", "note"),
)


def note_of(s: Snapshot) -> str:
    n = s.numerics
    return (
        s.info.skip_reason
        or s.info.details.get("warning", "")
        or (n.error if n is not None and not n.ok else "")
        or s.info.details.get("summary", "")
        or ""
    )


def _pipeline_row(s: Snapshot, prev_nodes: int) -> str:
    n = s.numerics
    ok = n is not None and n.ok
    numerics = (
        [fmt_error(n.rmse_ratio), fmt_error(n.max_abs), fmt_fraction(n.top1_agreement)]
        if ok and n is not None
        else ["off" if n is None else "n/a", "", ""]
    )
    mem = fmt_mib(s.mem_delta / 2**20, signed=True) + (" !" if s.mem_warning else "")
    note = note_of(s) + (f" (memory: {s.mem_warning})" if s.mem_warning else "")
    cells = [
        _e(s.index),
        _e(s.stage.value),
        step_link(s),
        f'<span class="status-{_e(s.status)}">{_e(s.status)}</span>',
        _e(s.info.num_matches),
        _e(fmt_seconds(s.times.total)),
        _e(s.num_nodes),
        _e(f"{s.num_nodes - prev_nodes:+d}"),
        _e(mem),
        *(_e(x) for x in numerics),
        _e(note),
    ]
    tds = "".join(
        f'<td class="{cls}">{c}</td>' if cls else f"<td>{c}</td>" for (_, cls), c in zip(_PIPELINE_HEAD, cells)
    )
    cls = ' class="warn"' if s.mem_warning else ""
    return f"<tr{cls}>{tds}</tr>"


def pipeline_table(snaps: List[Snapshot], folded: List[bool]) -> str:
    """One row per transform that did something; the ones that changed nothing fold into one line
    at the end of their stage (it opens to links to their sections)."""
    rows: List[str] = []
    quiet: List[Snapshot] = []
    prev = 0
    for i, s in enumerate(snaps):
        if folded[i]:
            quiet.append(s)
        else:
            rows.append(_pipeline_row(s, prev))
        prev = s.num_nodes
        if quiet and (i + 1 == len(snaps) or snaps[i + 1].stage != s.stage):
            links = " ".join(step_link(q) for q in quiet)
            rows.append(
                f'<tr class="fold"><td colspan="{len(_PIPELINE_HEAD)}"><details><summary>{_e(s.stage.value)}: '
                f"{len(quiet)} transform{'s' if len(quiet) > 1 else ''} changed nothing on this model"
                f"</summary>{links}</details></td></tr>"
            )
            quiet = []
    header = "".join(f"<th>{_e(h)}</th>" for h, _ in _PIPELINE_HEAD)
    return f'<table id="pipeline"><tr>{header}</tr>{"".join(rows)}</table>'


def _mem(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _worst_numerics(snaps: List[Snapshot]) -> str:
    probed = [(s, s.numerics) for s in snaps if s.numerics is not None and s.numerics.ok]
    rmse = [(n.rmse_ratio, s, n) for s, n in probed if n.rmse_ratio is not None]
    failed = [s for s in snaps if s.numerics is not None and not s.numerics.ok]
    if not rmse and not failed:
        return "off (no numerics probe ran)"
    parts = []
    if rmse:
        worst, snap, n = max(rmse, key=lambda t: t[0])  # the first step that reached it
        if not worst:
            parts.append(f"exact at every probed step ({len(rmse)})")
        else:
            parts.append(
                f"worst rmse ratio {fmt_error(worst)} (max abs {fmt_error(n.max_abs)}, top1 "
                f"{fmt_fraction(n.top1_agreement)}), first reached at "
                f'<a href="#{section_id(snap.index)}">#{snap.index:02d} {_e(snap.key)}</a>'
            )
    if failed:
        parts.append(f"{len(failed)} probe(s) could not run, the first at #{failed[0].index:02d} {_e(failed[0].key)}")
    return "; ".join(parts)


def summary_rows(stepper: Any, snaps: List[Snapshot], folded: List[bool]) -> List[Tuple[str, str]]:
    """The summary of ``workbench run`` as far as it is known when the report is written: model,
    where and how it runs, the answer and its speed (when it generated), the pipeline's time,
    memory, numerics."""
    model = getattr(stepper, "loaded", None)
    rows = [("model", _e(model if model is not None else "?"))]
    try:
        rows.append(("ran", _e(stepper.backends_line())))
    except Exception:  # noqa: BLE001 - a stepper without one (a bare PipelineStepper): leave the row out
        pass
    error = getattr(stepper, "last_error", None)
    status = f'<span class="warn">stopped at an error: {_e(error)}</span>; ' if error is not None else ""
    counts = ", ".join(
        f"{sum(1 for s in snaps if s.status == st)} {st}"
        for st in ("done", "skipped", "failed")
        if any(s.status == st for s in snaps)
    )
    folded_n = sum(folded)
    planned = len(getattr(stepper, "entries", None) or snaps)
    rows.append(
        (
            "pipeline",
            f"{status}{len(snaps)}{f' of {planned}' if planned > len(snaps) else ''} transforms run in "
            f"{fmt_seconds(sum(s.times.total for s in snaps))}"
            + (f" ({counts})" if counts else "")
            + (f"; {folded_n} changed nothing on this model (folded below)" if folded_n else ""),
        )
    )
    memory = []
    if snaps:
        last = snaps[-1].mem_after
        if last.param_bytes + last.buffer_bytes:  # zero before load_weights: the graph is on meta
            memory.append(f"weights {_mem(last.param_bytes + last.buffer_bytes)}")
    ctx = getattr(stepper, "ctx", None)
    try:
        cache = ctx.cache_bytes() if ctx is not None else None
    except Exception:  # noqa: BLE001 - no cache yet
        cache = None
    if cache:
        memory.append(f"KV cache {_mem(cache)}")
    if memory:
        rows.append(("memory", ", ".join(memory)))
    rows.append(("numerics", _worst_numerics(snaps)))
    out = getattr(stepper, "last_generation", None)  # Workbench.generate's last output, if any
    if out is not None and out.results:
        first = out.results[0]
        answer = f"error: {first.error}" if first.error else (first.text or str(first.token_ids))
        rows.insert(2, ("answer", _e(answer)))
        ttft = out.stats.time_to_first_token_s
        speed = f"first token {ttft * 1e3:.0f} ms, " if ttft is not None else ""
        rows.insert(3, ("speed", f"{speed}decode {out.stats.decode_tokens_per_s:.1f} tok/s"))
    return rows


def summary_html(rows: List[Tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="summary" id="summary">{body}</table>'


# ------------------------------------------------------------------------------ sections
