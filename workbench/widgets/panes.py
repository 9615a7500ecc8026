"""HTML for the panel's panes, built from snapshots with ``workbench.viz`` (no widgets here).

Each function takes what it shows (snapshots, a workbench for read-only facts) and returns an HTML
string, so the panel only decides *which* snapshot to show and the functions can be tested alone.
Graph layout by ``dot`` is the slow part; ``SvgCache`` keeps recent renders of immutable snapshots.
"""

from __future__ import annotations

import html
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pandas as pd

from ..pipeline.numerics import exceeds
from ..pipeline.snapshot import Snapshot
from ..viz import GraphTooLargeError, diff_snapshots, render_diff, render_snapshot, to_svg
from ..viz.diff import GONE_CHANGES, GraphDiff
from ..viz.svg_viewer import svg_viewer_iframe

STATUS_COLORS = {"done": "#2e7d32", "skipped": "#757575", "failed": "#c62828", "stale": "#ef6c00", "pending": "#9e9e9e"}
SCROLL = "<div style='overflow:auto;max-height:{h}px;border:1px solid #ddd'>{body}</div>"


def esc(text: Any) -> str:
    return html.escape(str(text))


def note(text: str, color: str = "#555") -> str:
    return f"<div style='color:{color};white-space:pre-wrap'>{esc(text)}</div>"


def error(text: str) -> str:
    return (
        f"<div class='wb-error' style='color:#b71c1c;background:#ffebee;padding:4px 8px;"
        f"white-space:pre-wrap;font-family:monospace'>{esc(text)}</div>"
    )


def badge(status: str) -> str:
    color = STATUS_COLORS.get(status, "#555")
    return f"<span style='background:{color};color:white;border-radius:3px;padding:0 5px;font-size:85%'>{status}</span>"


def frame_html(df: pd.DataFrame, max_rows: int = 60) -> str:
    more = f"<p><i>{len(df) - max_rows} more rows</i></p>" if len(df) > max_rows else ""
    return df.head(max_rows).to_html(index=False, border=0, na_rep="") + more


class SvgCache:
    """The last ``size`` renders by (snapshot, view). Snapshots are immutable, so entries never go
    stale; the snapshot object is kept in the entry so its ``id`` cannot be reused meanwhile."""

    def __init__(self, size: int = 24):
        self.size = size
        self._items: "OrderedDict[Tuple, Tuple[Any, str]]" = OrderedDict()

    def get(self, snaps: Sequence[Snapshot], view: Tuple, make: Callable[[], str]) -> str:
        key = (tuple(id(s) for s in snaps), view)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key][1]
        svg = make()
        self._items[key] = (tuple(snaps), svg)
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return svg

    def clear(self) -> None:
        self._items.clear()


def snapshot_facts(snap: Optional[Snapshot], key: str, status: str) -> str:
    """One line about the selected transform: status, matches, time, nodes, memory, notes."""
    if snap is None:
        return f"<b>{esc(key)}</b> {badge(status)} <i>not run</i>"
    n = snap.numerics
    num = (
        ""
        if n is None
        else f" &middot; rmse ratio {n.rmse_ratio:.2e}"
        if n.ok
        else f" &middot; numerics: {esc(n.error)}"
    )
    extra = "".join(f" &middot; {esc(k)}={esc(v)}" for k, v in snap.info.details.items())
    reason = f" &middot; <i>{esc(snap.info.skip_reason)}</i>" if snap.info.skip_reason else ""
    warn = f" &middot; <span style='color:#c62828'>{esc(snap.mem_warning)}</span>" if snap.mem_warning else ""
    return (
        f"<b>#{snap.index:02d} {esc(key)}</b> [{snap.stage.value}] {badge(status)} &middot; "
        f"{snap.info.num_matches} matches &middot; {snap.times.total * 1000:.1f} ms &middot; "
        f"{snap.num_nodes} nodes &middot; Δmem {snap.mem_delta / 2**20:+.2f} MiB"
        f"{num}{reason}{warn}{extra}"
    )


def graph_html(
    snap: Optional[Snapshot], expand: Optional[int], cache: SvgCache, empty: str = "Nothing has run yet."
) -> str:
    """The collapsed render of ``snap`` (decoder layer ``expand`` opened, if given)."""
    if snap is None:
        return note(empty)
    if snap.graph is None:
        return note(f"{snap.key} kept no graph (the workbench runs with snapshots=False).")
    view = ("graph", expand)
    try:
        svg = cache.get(
            [snap],
            view,
            lambda: to_svg(render_snapshot(snap, collapsed=True, expand=[] if expand is None else [expand])),
        )
    except (ValueError, GraphTooLargeError) as e:
        return error(str(e))
    return svg_viewer_iframe(svg)


def diff_marks(diff: GraphDiff) -> Dict[str, str]:
    """Node name -> ``added``/``modified`` for the later graph's changed nodes."""
    t = diff.nodes
    return {
        name: ("modified" if change == "modified" else "added")
        for name, change in zip(t["name"], t["change"])
        if change not in GONE_CHANGES
    }


def diff_html(before: Optional[Snapshot], after: Optional[Snapshot], expand: Optional[int], cache: SvgCache) -> str:
    """Summary, op-count deltas, node table and the highlighted render of ``before -> after``.

    A change too large for the node-level diff picture is shown on the collapsed render instead
    (changed nodes highlighted, with ``expand`` opened), so the picture is never refused.
    """
    if after is None:
        return note("Select a transform that has run.")
    if before is None:
        return note(f"#{after.index:02d} {after.key} is the first snapshot: nothing to compare with.")
    if after.graph is None or before.graph is None:
        return note("These snapshots kept no graph (snapshots=False).")
    diff = diff_snapshots(before, after)
    parts = [f"<p><b>{esc(diff.summary())}</b></p>"]
    if diff.empty:
        return parts[0] + note("The graphs are identical.")
    parts += [
        "<b>op counts</b>",
        frame_html(diff.op_delta),
        "<b>changed nodes</b>",
        SCROLL.format(h=240, body=frame_html(diff.nodes, 200)),
    ]
    try:
        svg = cache.get([before, after], ("diff",), lambda: to_svg(render_diff(diff)))
        caption = "new nodes green, removed ones grey"
    except GraphTooLargeError:
        marks = diff_marks(diff)
        svg = cache.get(
            [before, after],
            ("diff-collapsed", expand),
            lambda: to_svg(
                render_snapshot(after, collapsed=True, expand=[] if expand is None else [expand], marks=marks)
            ),
        )
        caption = (
            "too many changes for the node-level picture: the collapsed graph with the "
            "changed nodes highlighted (open a layer to see them one by one)"
        )
    parts += [f"<p><i>{caption}</i></p>", svg_viewer_iframe(svg, 560)]
    return "".join(parts)


def first_divergent(snaps: Sequence[Snapshot], tol: float, metric: str = "rmse_ratio") -> Optional[Snapshot]:
    """``Workbench.bisect`` over the snapshots that exist, without running anything."""
    return next((s for s in snaps if exceeds(s.numerics, tol, metric)), None)


def numerics_html(snaps: Sequence[Snapshot], tol: float, enabled: bool) -> str:
    if not enabled:
        return note("Numerics are off for this workbench (create it with numerics=True).")
    if not snaps:
        return note("Nothing has run yet.")
    bad = first_divergent(snaps, tol)
    head = (
        f"<p style='color:#c62828'><b>first transform past rmse ratio {tol:g}: #{bad.index:02d} {esc(bad.key)}</b></p>"
        if bad
        else f"<p style='color:#2e7d32'>every snapshot is within rmse ratio {tol:g} of eager</p>"
    )
    rows: List[str] = []
    for s in snaps:
        n = s.numerics
        if n is None:
            cells = ["", "", ""]
        elif n.ok:
            cells = [f"{n.max_abs:.3e}", f"{n.rmse_ratio:.3e}", f"{n.top1_agreement:.3f}"]
        else:
            cells = ["", "", esc(n.error)]
        style = " style='background:#ffcdd2;font-weight:bold'" if s is bad else ""
        rows.append(
            f"<tr{style}><td>{s.index}</td><td>{esc(s.key)}</td><td>{s.status}</td>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    return (
        head + "<table class='wb-numerics'><tr><th>#</th><th>transform</th><th>status</th>"
        "<th>max abs</th><th>rmse ratio</th><th>top-1 agree</th></tr>" + "".join(rows) + "</table>"
    )


def charts_tables_html(memory: pd.DataFrame, timing: pd.DataFrame) -> str:
    """The numbers under the chart: time per phase and the memory deltas with their warnings."""
    if timing.empty:
        return note("Nothing has run yet.")
    t = timing[["#", "transform", "total_s", "apply_s", "d_nodes"]].round(4)
    m = memory[["#", "delta_MiB", "tracked_after_MiB", "warning"]].round(3)
    return SCROLL.format(h=360, body=frame_html(t.merge(m, on="#"), 200))
