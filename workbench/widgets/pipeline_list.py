"""The pipeline list: one row per transform, grouped by stage.

A row is an enable checkbox, the transform's name (click to select it), its status badge and
its numbers (matches, time, numerics). Rows are built once per pipeline and only their values
change on render. ``on_toggle(key, enabled)`` and ``on_select(key)`` are the panel's handlers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import ipywidgets as W

from ..pipeline.config import PipelineEntry
from ..pipeline.snapshot import Snapshot
from .panes import badge, esc


@dataclass
class RowView:
    """What one row shows; computed by the panel from the workbench and its own memory."""

    key: str
    enabled: bool
    status: str  # pending / done / skipped / failed / stale
    snap: Optional[Snapshot]  # the current snapshot, or the stale one it last saw
    selected: bool
    divergent: bool  # the first transform past the numerics tolerance
    next_to_run: bool


# Rows keep their height in the scrolling list (a flex child would otherwise shrink to fit).
ROW = W.Layout(flex="0 0 auto")


class PipelineList:
    def __init__(
        self, entries: Sequence[PipelineEntry], on_toggle: Callable[[str, bool], None], on_select: Callable[[str], None]
    ):
        self.checkboxes: Dict[str, W.Checkbox] = {}
        self.names: Dict[str, W.Button] = {}
        self.cells: Dict[str, W.HTML] = {}
        children: List[W.Widget] = []
        # wide enough for the longest key at 12 px (~7 px a character), so no name is cut
        name_px = max(240, 7 * max((len(e.key) for e in entries), default=0) + 28)
        stage = None
        for e in entries:
            if e.config.stage != stage:
                stage = e.config.stage
                children.append(
                    W.HTML(
                        f"<div style='margin-top:6px;border-bottom:1px solid #ccc'><b>{stage.value}</b></div>",
                        layout=ROW,
                    )
                )
            cb = W.Checkbox(
                value=e.config.enabled,
                indent=False,
                layout=W.Layout(width="24px"),
                description_tooltip=f"enable {e.key}",
            )
            cb.observe(lambda ch, k=e.key: on_toggle(k, ch["new"]), names="value")
            name = W.Button(
                description=e.key,
                tooltip=f"select {e.key}",
                style={"font_size": "12px"},
                layout=W.Layout(width=f"{name_px}px", height="24px", flex="0 0 auto"),
            )
            name.on_click(lambda _b, k=e.key: on_select(k))
            name.add_class("wb-transform")
            cell = W.HTML(layout=W.Layout(width="320px"))
            self.checkboxes[e.key], self.names[e.key], self.cells[e.key] = cb, name, cell
            children.append(W.HBox([cb, name, cell], layout=W.Layout(align_items="center", flex="0 0 auto")))
        self.box = W.VBox(
            children,
            layout=W.Layout(overflow_y="auto", max_height="720px", width=f"{name_px + 360}px", flex="0 0 auto"),
        )

    def update(self, rows: Sequence[RowView], busy: bool) -> None:
        """Set every row's values (the caller guards against the checkbox observers firing)."""
        for r in rows:
            cb = self.checkboxes[r.key]
            cb.value, cb.disabled = r.enabled, busy
            self.names[r.key].button_style = "info" if r.selected else ""
            self.cells[r.key].value = self._cell(r)

    @staticmethod
    def _cell(r: RowView) -> str:
        parts = [badge(r.status)]
        s = r.snap
        if s is not None:
            dim = " style='color:#999'" if r.status == "stale" else ""
            parts.append(f"<span{dim}>{s.info.num_matches} matches &middot; {s.times.total * 1000:.0f} ms</span>")
            n = s.numerics
            if n is not None and n.ok:
                style = (
                    "background:#ffcdd2;color:#b71c1c;font-weight:bold"
                    if r.divergent
                    else "color:#999"
                    if r.status == "stale"
                    else "color:#555"
                )
                flag = " first divergent" if r.divergent else ""
                parts.append(
                    f"<span class='wb-numerics-cell' style='{style}' "
                    f"title='rmse ratio vs eager'>{n.rmse_ratio:.1e}{flag}</span>"
                )
        if r.next_to_run:
            parts.append("<span style='color:#1565c0'>&larr; next</span>")
        return f"<span style='white-space:nowrap' title='{esc(r.key)}'>{' '.join(parts)}</span>"
