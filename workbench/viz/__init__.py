"""Seeing the pipeline: renders, collapsed views, diffs, provenance, charts and the HTML report.

Reads snapshots only; nothing in ``workbench.pipeline`` imports this package.
"""

from .charts import memory_frame, plot_memory, plot_nodes, plot_pipeline, plot_pipeline_rows, plot_times, timing_frame
from .collapse import assign_layers, layer_of_path
from .diff import GraphDiff, diff_graphs, diff_snapshots, op_count_delta
from .diff_view import render_diff
from .provenance import created_by, module_path, provenance, replaces, source_location, stack_trace
from .render import DotMissingError, render_graph, render_snapshot, to_svg, write_snapshot_svg, write_svg
from .report import write_report
from .select import DEFAULT_MAX_NODES, GraphTooLargeError

__all__ = [
    "DEFAULT_MAX_NODES",
    "DotMissingError",
    "GraphDiff",
    "GraphTooLargeError",
    "assign_layers",
    "created_by",
    "diff_graphs",
    "diff_snapshots",
    "layer_of_path",
    "memory_frame",
    "module_path",
    "op_count_delta",
    "plot_memory",
    "plot_nodes",
    "plot_pipeline",
    "plot_pipeline_rows",
    "plot_times",
    "provenance",
    "render_diff",
    "render_graph",
    "render_snapshot",
    "replaces",
    "source_location",
    "stack_trace",
    "timing_frame",
    "to_svg",
    "write_report",
    "write_snapshot_svg",
    "write_svg",
]
