"""``WorkbenchPanel``: the notebook panel over a ``Workbench`` (what ``wb.ui()`` returns).

A thin shell over the step-through API, after pytensor's ipython.py: every handler calls the
workbench (``step``, ``configure``, ``enable``, ``rewind``, ``reset``, ``generate``) and then
``render()``, the one method that redraws the panel from the workbench's state. ``render`` is
guarded against re-entrance (setting a checkbox while drawing must not toggle a transform), and
the panel holds only view state: the selection, the pane options, and the snapshots it has shown
(``seen``), which is how a transform invalidated by an edit is shown as *stale* until it re-runs.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import ipywidgets as W

from ..pipeline.snapshot import Snapshot
from ..viz import memory_frame, plot_pipeline_rows, timing_frame
from ..viz.charts import figure_png
from . import panes
from .config_form import ConfigForm
from .generate_box import GenerateBox
from .panel_actions import PanelActions
from .pipeline_list import PipelineList, RowView
from .selector_bar import SelectorBar
from .worker import Worker

TABS = ("Graph", "Diff", "Config", "Charts", "Numerics", "Generate")


def _button(description: str, icon: str, tooltip: str, style: str = "") -> W.Button:
    b = W.Button(description=description, icon=icon, tooltip=tooltip, button_style=style, layout=W.Layout(width="auto"))
    b.add_class("wb-" + description.lower().replace(" ", "-"))
    return b


def _set_options(dropdown: W.Dropdown, options: List[tuple]) -> None:
    """Replace a dropdown's options only when they changed, keeping its value if still offered."""
    if tuple(dropdown.options) == tuple(options):
        return
    value = dropdown.value
    dropdown.options = options
    dropdown.value = value if value in [v for _, v in options] else options[0][1]


class WorkbenchPanel(PanelActions):
    """The panel. ``background=None`` runs jobs in a thread inside a kernel, inline elsewhere;
    ``auto_rerun`` re-runs an edited pipeline back to where it was; ``tol`` is the numerics
    tolerance (rmse ratio vs eager) that marks the first divergent transform."""

    def __init__(self, wb: Any, *, background: Optional[bool] = None, auto_rerun: bool = True, tol: float = 1e-3):
        self.wb = wb
        self.worker = Worker(background)
        self.seen: Dict[str, Snapshot] = {}
        self.selected = wb.snapshots[-1].key if wb.snapshots else wb.keys[0]
        self.svgs = panes.SvgCache()
        self._render_lock = threading.Lock()
        self._rendering = self._dirty = False
        self._form: Optional[ConfigForm] = None
        self._form_for: Any = None
        self._pane_key: Any = None
        self._goal = 0  # the position the last run was heading for
        self._build(auto_rerun, tol)
        self.render()

    # ------------------------------------------------------------------ layout
    def _build(self, auto_rerun: bool, tol: float) -> None:
        self.title = W.HTML()
        self.selectors = SelectorBar(self._on_choice)
        self.step_button = _button("Step", "step-forward", "run the next transform", "primary")
        self.run_to_button = _button("Run to selected", "forward", "run up to the selected transform")
        self.run_all_button = _button("Run all", "fast-forward", "run the rest of the pipeline")
        self.stop_button = _button("Stop", "stop", "stop after the current transform", "warning")
        self.rewind_button = _button("Rewind", "undo", "go back so the selected transform runs next")
        self.reset_button = _button("Reset", "refresh", "back to the eager model", "danger")
        for b, fn in (
            (self.step_button, self.step),
            (self.run_to_button, self.run_to_selected),
            (self.run_all_button, self.run_all),
            (self.stop_button, self.stop),
            (self.rewind_button, self.rewind),
            (self.reset_button, self.reset),
        ):
            b.on_click(lambda _b, fn=fn: fn())
        self.auto_rerun = W.Checkbox(
            value=auto_rerun, description="re-run after edits", indent=False, layout=W.Layout(width="160px")
        )
        self.tol = W.FloatText(
            value=tol,
            description="tol",
            layout=W.Layout(width="150px"),
            description_tooltip="rmse ratio vs eager that counts as divergent",
        )
        self.progress = W.IntProgress(min=0, max=max(len(self.wb.entries), 1), layout=W.Layout(width="300px"))
        self.message = W.HTML()
        self.pipeline = PipelineList(self.wb.entries, self._on_toggle, self.select)
        self.facts = W.HTML()
        # panes
        self.layer = W.Dropdown(description="layer", layout=W.Layout(width="260px"))
        self.graph = W.HTML()
        self.graph.add_class("wb-graph")
        self.explore_button = _button(
            "Model Explorer", "sitemap", "open the selected snapshot in Model Explorer (pan, zoom, search, overlays)"
        )
        self.explore_button.on_click(lambda _b: self.explore_selected())
        self.explorer = W.HTML()
        self.compare = W.Dropdown(
            description="compare with", layout=W.Layout(width="360px"), style={"description_width": "100px"}
        )
        self.diff = W.HTML()
        self.diff.add_class("wb-diff")
        self.config_box = W.VBox()
        self.apply_button = _button("Apply", "check", "validate and apply the changed fields", "success")
        self.apply_button.layout.width = "120px"
        self.apply_button.on_click(lambda _b: self.apply_config())
        self.config_error = W.HTML()
        # Shown at its own size (940 px, one row per transform) and never stretched; the box scrolls.
        self.chart = W.Image(
            format="png", layout=W.Layout(max_width="100%", max_height="none", height="auto", flex="0 0 auto")
        )
        self.chart.add_class("wb-chart")
        self.chart_table = W.HTML()
        self.numerics = W.HTML()
        self.generate_box = GenerateBox(self._start_job, lambda: self.worker.stop_requested)
        self.tabs = W.Tab(
            [
                W.VBox([W.HBox([self.layer, self.explore_button]), self.explorer, self.graph]),
                W.VBox([self.compare, self.diff]),
                W.VBox([self.config_box, self.apply_button, self.config_error]),
                W.VBox(
                    [
                        W.VBox(
                            [self.chart], layout=W.Layout(overflow="auto", max_height="640px", align_items="flex-start")
                        ),
                        self.chart_table,
                    ]
                ),
                self.numerics,
                self.generate_box.box,
            ],
            titles=TABS,
            layout=W.Layout(width="100%"),
        )
        for w in (self.tabs, self.layer, self.compare, self.tol):
            w.observe(lambda _ch: self.render(), names="selected_index" if w is self.tabs else "value")
        self.panes = W.VBox([self.facts, self.tabs], layout=W.Layout(flex="1 1 600px", min_width="600px"))
        self.panes.add_class("wb-panes")
        controls = W.HBox(
            [
                self.step_button,
                self.run_to_button,
                self.run_all_button,
                self.stop_button,
                self.rewind_button,
                self.reset_button,
                self.auto_rerun,
                self.tol,
            ]
        )
        self.widget = W.VBox(
            [
                self.title,
                self.selectors.box,
                controls,
                W.HBox([self.progress, self.message]),
                # Side by side where there is room for both; with JupyterLab's file browser open
                # at 1400 px there is not, and the panes wrap below the list at full width.
                W.HBox([self.pipeline.box, self.panes], layout=W.Layout(flex_flow="row wrap")),
            ]
        )
        self.widget.add_class("wb-panel")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # ------------------------------------------------------------------ render
    def render(self) -> None:
        """Redraw everything from the workbench's state (safe to call from any thread)."""
        if not self._render_lock.acquire(blocking=False):
            self._dirty = True  # the running render draws again when it ends
            return
        try:
            self._rendering = True
            self._dirty = True
            while self._dirty:
                self._dirty = False
                self._render()
        finally:
            self._rendering = False
            self._render_lock.release()

    def _render(self) -> None:
        wb, busy = self.wb, self.worker.busy
        snaps = list(wb.snapshots)
        for s in snaps:
            self.seen[s.key] = s
        n = len(wb.entries)
        self.title.value = (
            f"<h3 style='margin:4px 0'>workbench: {panes.esc(wb.ctx.spec)} "
            f"<small>{str(wb.ctx.dtype).replace('torch.', '')} on {wb.ctx.device}"
            f" &middot; {len(snaps)}/{n} transforms run</small></h3>"
        )
        self.progress.max, self.progress.value = n, len(snaps)
        self.progress.bar_style = (
            "info" if busy else "danger" if wb.last_error else "success" if len(snaps) == n else ""
        )
        for b in (self.step_button, self.run_to_button, self.run_all_button):
            b.disabled = busy or wb.done
        self.rewind_button.disabled = self.reset_button.disabled = busy
        self.stop_button.disabled = not busy
        self.selectors.update(wb, busy)
        rows = self.rows(self.tol.value)
        self.pipeline.update(rows, busy)
        row = next(r for r in rows if r.key == self.selected)
        snap = snaps[wb.index(self.selected)] if wb.index(self.selected) < len(snaps) else None
        self.facts.value = panes.snapshot_facts(snap or row.snap, self.selected, row.status)
        self.generate_box.update(wb, busy)
        if not busy:  # layouts (dot) and charts wait until a run ends
            self._render_pane(snaps, snap)

    def rows(self, tol: float) -> List[RowView]:
        """Every transform's row: status (with *stale* from ``seen``), snapshot, flags."""
        wb, snaps = self.wb, self.wb.snapshots
        bad = panes.first_divergent(snaps, tol) if wb.numerics_enabled else None
        out = []
        for i, e in enumerate(wb.entries):
            if i < len(snaps):
                snap, status = snaps[i], snaps[i].status
            else:
                snap = self.seen.get(e.key)
                status = "failed" if wb.status(e.key) == "failed" else "stale" if snap is not None else "pending"
            out.append(
                RowView(
                    e.key,
                    e.config.enabled,
                    status,
                    snap,
                    e.key == self.selected,
                    snap is bad and bad is not None,
                    i == len(snaps),
                )
            )
        return out

    def _render_pane(self, snaps: List[Snapshot], snap: Optional[Snapshot]) -> None:
        tab = TABS[self.tabs.selected_index or 0]
        layers = int(getattr(self.wb.ctx.config, "num_hidden_layers", 0) or 0)
        _set_options(self.layer, [("all layers collapsed", -1)] + [(f"layer {i}", i) for i in range(layers)])
        _set_options(self.compare, [("previous snapshot", -1)] + [(f"#{s.index:02d} {s.key}", s.index) for s in snaps])
        expand = None if self.layer.value in (None, -1) else self.layer.value
        if tab == "Config":
            self._render_config()
            return
        key = (tab, tuple(id(s) for s in snaps), self.selected, expand, self.compare.value, self.tol.value)
        if key == self._pane_key:
            return
        self._pane_key = key
        if tab == "Graph":
            empty = (
                f"{self.selected} has not run yet: run to it, or select one that has run."
                if snaps
                else "Nothing has run yet: press Step (or Run all) to export the model."
            )
            self.graph.value = panes.graph_html(snap, expand, self.svgs, empty)
        elif tab == "Diff":
            c = self.compare.value
            if c in (None, -1):  # the previous snapshot
                base = snaps[snap.index - 1] if snap is not None and snap.index > 0 else None
            else:
                base = snaps[c] if c < len(snaps) else None
            self.diff.value = panes.diff_html(base, snap, expand, self.svgs)
        elif tab == "Charts":
            self.chart.value = figure_png(plot_pipeline_rows(snaps)) if snaps else b""
            self.chart_table.value = panes.charts_tables_html(memory_frame(snaps), timing_frame(snaps))
        elif tab == "Numerics":
            self.numerics.value = panes.numerics_html(snaps, self.tol.value, self.wb.numerics_enabled)

    def _render_config(self) -> None:
        entry = self.wb.entries[self.wb.index(self.selected)]
        if self._form_for is not entry.config:  # rebuilt only when the config itself changed
            self._form, self._form_for = ConfigForm(entry.key, entry.config), entry.config
            self.config_box.children = [self._form.box]

    # ------------------------------------------------------------------ handlers
    def select(self, key: str) -> None:
        self.wb.index(key)  # KeyError with the known keys for a typo
        self.selected = key
        self.config_error.value = ""
        self.render()

    def _say(self, text: str, color: str = "#333") -> None:
        self.message.value = f"<span style='color:{color}'>{panes.esc(text)}</span>"
