"""Time, node-count and memory views of a pipeline run: DataFrames and matplotlib figures.

Figures are built as ``matplotlib.figure.Figure`` objects with an Agg canvas attached, never
through ``pyplot``: no global figure registry, no backend switch, nothing to close, and they work
headless. A returned ``ChartFigure`` shows itself in a notebook as PNG (``_repr_png_``);
``figure_png`` gives the bytes.

Memory is the "tracked" number the pipeline warns about (CUDA allocated on a GPU; parameter +
buffer + cache bytes on CPU). A transform whose memory moved although its config did not expect
it (``snapshot.mem_warning``) is drawn in red.
"""

from __future__ import annotations

import io
from typing import Any, List, Sequence, Union

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..pipeline.snapshot import Snapshot

MiB = 2**20
PHASES = (("pre_cleanup", "#90caf9"), ("apply", "#1e88e5"), ("post_cleanup", "#0d47a1"))
UNEXPECTED = "#d32f2f"

Snapshots = Union[Sequence[Snapshot], Any]  # a list of snapshots or anything with .snapshots


def _snaps(obj: Snapshots) -> List[Snapshot]:
    return list(getattr(obj, "snapshots", obj))


def _label(s: Snapshot) -> str:
    return f"{s.index:02d} {s.key}"


def tracked_bytes(stats) -> int:
    """CUDA allocated when measured, else parameter + buffer + cache bytes (see memory.py)."""
    return stats.cuda_allocated if stats.cuda_allocated is not None else stats.tracked_bytes


def timing_frame(snapshots: Snapshots) -> pd.DataFrame:
    """Per transform: wall time by phase (seconds), node count and its change."""
    rows, prev = [], 0
    for s in _snaps(snapshots):
        rows.append(
            {
                "#": s.index,
                "transform": s.key,
                "stage": s.stage.value,
                "status": s.status,
                "pre_cleanup_s": s.times.pre_cleanup,
                "apply_s": s.times.apply,
                "post_cleanup_s": s.times.post_cleanup,
                "total_s": s.times.total,
                "nodes": s.num_nodes,
                "d_nodes": s.num_nodes - prev,
            }
        )
        prev = s.num_nodes
    return pd.DataFrame(rows)


def memory_frame(snapshots: Snapshots) -> pd.DataFrame:
    """Per transform: memory before/after (MiB) by kind, the tracked delta, and the warning."""
    rows = []
    for s in _snaps(snapshots):
        b, a = s.mem_before, s.mem_after
        rows.append(
            {
                "#": s.index,
                "transform": s.key,
                "tracked_before_MiB": tracked_bytes(b) / MiB,
                "tracked_after_MiB": tracked_bytes(a) / MiB,
                "delta_MiB": s.mem_delta / MiB,
                "params_after_MiB": a.param_bytes / MiB,
                "buffers_after_MiB": a.buffer_bytes / MiB,
                "cache_after_MiB": a.cache_bytes / MiB,
                "rss_before_MiB": b.rss_bytes / MiB,
                "rss_after_MiB": a.rss_bytes / MiB,
                "expect_mem_change": s.config.expect_mem_change,
                "unexpected": s.mem_warning is not None,
                "warning": s.mem_warning or "",
            }
        )
    return pd.DataFrame(rows)


class ChartFigure(Figure):
    """A Figure that shows itself in a notebook as PNG, with no pyplot backend set up."""

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def _new_figure(width: float, height: float, rows: int = 1) -> tuple:
    fig = ChartFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _width(n: int) -> float:
    return max(6.0, min(0.45 * n + 3.0, 24.0))


def draw_times(ax, snaps: List[Snapshot]) -> None:
    x = range(len(snaps))
    bottom = [0.0] * len(snaps)
    for phase, color in PHASES:
        vals = [getattr(s.times, phase) for s in snaps]
        ax.bar(x, vals, bottom=bottom, color=color, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("wall time (s)")
    ax.set_title("time per transform, by phase")
    ax.legend(fontsize=8, loc="upper right")


def draw_nodes(ax, snaps: List[Snapshot]) -> None:
    ax.plot(range(len(snaps)), [s.num_nodes for s in snaps], marker="o", color="#43a047")
    ax.set_ylabel("graph nodes")
    ax.set_title("node count after each transform")
    ax.grid(alpha=0.3)


def draw_memory(ax, snaps: List[Snapshot]) -> None:
    x = list(range(len(snaps)))
    before = [tracked_bytes(s.mem_before) / MiB for s in snaps]
    after = [tracked_bytes(s.mem_after) / MiB for s in snaps]
    colors = [UNEXPECTED if s.mem_warning else "#7e57c2" for s in snaps]
    ax.bar([i - 0.2 for i in x], before, width=0.4, color="#d1c4e9", label="before")
    ax.bar([i + 0.2 for i in x], after, width=0.4, color=colors, label="after")
    for i, s in enumerate(snaps):
        if s.mem_warning:
            ax.annotate(
                f"unexpected {s.mem_delta / MiB:+.1f} MiB",
                (i + 0.2, after[i]),
                color=UNEXPECTED,
                fontsize=8,
                ha="center",
                va="bottom",
            )
    ax.set_ylabel("tracked memory (MiB)")
    ax.set_title("memory before/after (red: changed although not expected)")
    ax.legend(fontsize=8, loc="upper right")


def _ticks(ax, snaps: List[Snapshot]) -> None:
    ax.set_xticks(range(len(snaps)))
    ax.set_xticklabels([_label(s) for s in snaps], rotation=35, ha="right", fontsize=8)


def _plot_one(snapshots: Snapshots, draw, height: float) -> Figure:
    """One chart (``draw(ax, snaps)``), one column per transform, labelled under it."""
    snaps = _snaps(snapshots)
    fig, (ax,) = _new_figure(_width(len(snaps)), height)
    draw(ax, snaps)
    _ticks(ax, snaps)
    return fig


def plot_times(snapshots: Snapshots) -> Figure:
    return _plot_one(snapshots, draw_times, 3.5)


def plot_nodes(snapshots: Snapshots) -> Figure:
    return _plot_one(snapshots, draw_nodes, 3.0)


def plot_memory(snapshots: Snapshots) -> Figure:
    return _plot_one(snapshots, draw_memory, 3.5)


def plot_pipeline(snapshots: Snapshots) -> Figure:
    """Time, node count and memory stacked, one column per transform (the report's overview)."""
    snaps = _snaps(snapshots)
    fig, axes = _new_figure(_width(len(snaps)), 8.5, rows=3)
    draw_times(axes[0], snaps)
    draw_nodes(axes[1], snaps)
    draw_memory(axes[2], snaps)
    _ticks(axes[2], snaps)
    return fig


ROW_INCH = 0.24  # one transform per row: 24 px at 100 dpi, room for a 9 pt label


def plot_pipeline_rows(snapshots: Snapshots, width: float = 9.4) -> Figure:
    """Time, node count and memory side by side, one *row* per transform (the panel's chart).

    ``plot_pipeline`` puts 60 transforms along the x axis: 24 inches wide, so a notebook pane
    shrinks it to a quarter and its 8 pt labels become 2 px. Here the labels are horizontal, the
    figure is ``width`` inches (940 px at 100 dpi, a JupyterLab pane with the file browser open)
    and grows downwards instead; each bar carries its number. Memory is the tracked bytes after the
    transform, red where it moved although the transform does not expect it to.
    """
    snaps = _snaps(snapshots)
    n = max(len(snaps), 1)
    fig = ChartFigure(figsize=(width, 1.3 + ROW_INCH * n), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_n, ax_m = fig.subplots(1, 3, sharey=True, width_ratios=(1.3, 1.0, 1.0))
    y = list(range(len(snaps)))
    left = [0.0] * len(snaps)
    for phase, color in PHASES:
        vals = [getattr(s.times, phase) for s in snaps]
        ax_t.barh(y, vals, left=left, color=color, label=phase.replace("_", " "))
        left = [a + v for a, v in zip(left, vals)]
    for i, s in enumerate(snaps):
        t = s.times.total
        ax_t.annotate(f" {t:.2f} s" if t >= 1 else f" {t * 1000:.0f} ms", (left[i], i), va="center", fontsize=8)
        ax_n.annotate(f" {s.num_nodes}", (s.num_nodes, i), va="center", fontsize=8)
    ax_n.barh(y, [s.num_nodes for s in snaps], color="#43a047")
    after = [tracked_bytes(s.mem_after) / MiB for s in snaps]
    ax_m.barh(y, after, color=[UNEXPECTED if s.mem_warning else "#7e57c2" for s in snaps])
    for i, s in enumerate(snaps):
        if s.mem_delta:
            color = UNEXPECTED if s.mem_warning else "#333"
            ax_m.annotate(f" {s.mem_delta / MiB:+.1f}", (after[i], i), va="center", fontsize=8, color=color)
    ax_t.set_yticks(y)
    ax_t.set_yticklabels([_label(s) for s in snaps], fontsize=9)
    ax_t.invert_yaxis()  # the pipeline reads top to bottom
    ax_t.legend(fontsize=8, loc="lower right")
    for ax, title in ((ax_t, "wall time (s)"), (ax_n, "nodes after"), (ax_m, "MiB after (change)")):
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, top=True, labeltop=True)  # the scale at both ends of a tall chart
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.25, y=0.005)  # room for the numbers at the bars' ends
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _changed_rows(frame: pd.DataFrame, cols: Sequence[str]) -> pd.DataFrame:
    """The first and last rows and every row whose ``cols`` differ from the row before."""
    keep = [0]
    for i in range(1, len(frame)):
        a, b = frame.iloc[i - 1], frame.iloc[i]
        if i == len(frame) - 1 or any(not (a[c] == b[c] or (pd.isna(a[c]) and pd.isna(b[c]))) for c in cols):
            keep.append(i)
    return frame.iloc[keep]


def plot_cost_across(frame: pd.DataFrame, title: str = "") -> Figure:
    """Predicted (roofline) and measured time per decode step and per prefill token after each
    transform, from ``workbench.analysis.cost.cost_across_pipeline`` (only the transforms that
    changed a number are drawn). Log scale: a cache turns a decode step from a re-run of the
    whole history into one token's work."""
    cols = [c for c in frame.columns if c.startswith(("predicted_", "measured_"))]
    rows = _changed_rows(frame, cols)
    fig, axes = _new_figure(_width(len(rows)), 6.0, rows=2)
    x = list(range(len(rows)))
    for ax, phase, unit in ((axes[0], "decode", "ms"), (axes[1], "prefill", "us_per_token")):
        pred, meas = f"predicted_{phase}_{unit}", f"measured_{phase}_{unit}"
        ax.plot(x, rows[pred], marker="o", color="#1e88e5", label="predicted (roofline)")
        if meas in rows:
            ax.plot(x, rows[meas], marker="s", linestyle="--", color="#e53935", label="measured here")
        ax.set_yscale("log")
        ax.set_ylabel("ms / decode step" if phase == "decode" else "us / prefill token")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_title(title or "what each transform bought: time per decode step and per prefill token")
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(
        [f"{r['#']:02d} {r['transform']}" for _, r in rows.iterrows()], rotation=35, ha="right", fontsize=8
    )
    return fig
