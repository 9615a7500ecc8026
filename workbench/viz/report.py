"""A standalone HTML report of a pipeline run: ``write_report(stepper, out_dir) -> index.html``.

One file that opens from disk with no server and no network, made to be shared:

* at the top, the run's summary (model, where and how it ran, pipeline time, memory, the worst
  numerics step), then the pipeline table with formatted numbers, where the transforms that changed
  nothing on this model (``run_summary.changed_nothing``) fold into one line per stage, as in
  ``workbench run``'s table;
* an overview chart (inline PNG) that scales to the page width (click it for full size);
* per transform a section: config, info, timing, memory, numerics, the diff against the previous
  snapshot (tables, and the diff picture when it is small enough) and the collapsed graph render,
  naming its Model Explorer files, packed in ``explorer.zip`` (``viz.explorer.report_links``; with
  the ``explorer`` extra installed).
  A transform that changed nothing is one line that opens to its details.

Each render is stored once: a snapshot whose graph did not change points to the render of the one
that made it (a 30-layer model's 60 snapshots have about 20 distinct graphs), and there is no second
copy beside the report. Blocks of HTML above ``PACK_OVER`` bytes (graph renders, large diff tables)
are stored gzip-compressed and base64-encoded in ``data-z`` attributes; a small inline script
unpacks them when the page opens (``DecompressionStream``: Chromium 80+, Firefox 113+, Safari
16.4+). Graphviz SVG compresses about 8:1, which keeps a 30-layer model's report near 2 MB instead
of 18. Once unpacked, the script records the rendered size of every graph in
``body[data-svg-sizes]`` and sets ``body[data-ready]``, which lets a headless browser test wait for
the pictures and check that they really render; each graph gets an "open full size" link (a blob URL
of its SVG).

Only the pictures need graphviz's ``dot`` binary. Without it (GPU machines often lack it) the report
is still written, tables, numbers and chart, with a notice at the top and each graph's Graphviz
source under ``dot/`` instead of its picture: the run's numbers are worth more than its drawings.
``index.html`` is written whole or not at all (a temporary file renamed), so a disk that fills up
mid-way leaves no truncated report that looks complete.
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import pandas as pd

from ..pipeline.snapshot import Snapshot
from .charts import figure_png, memory_frame, plot_pipeline, timing_frame
from .diff import NEW_CHANGES, GraphDiff, diff_snapshots
from .diff_view import render_diff
from .explorer.report_links import ExplorerArchive, archive_note, explorer_links, missing_note
from .outputs import dot_available, report_notice, report_notice_html, source_name, warn_once
from .render import DotMissingError, render_snapshot, to_svg
from .report_page import CSS, UNPACK_JS, fmt_kv, inline_svg, packed
from .report_top import folded_flags, note_of, pipeline_table, section_id, summary_html, summary_rows
from .select import GraphTooLargeError
from .sharding import plan_of, render_sharded_layer

MAX_DIFF_ROWS = 500
DIFF_HOPS = (2, 0)  # context around a diff picture; less when the picture would be too large


def _e(x: Any) -> str:
    return html.escape(str(x))


class _Pictures:
    """Lays out the report's pictures while ``dot`` is there; once it is not (missing from the start,
    or gone mid-way), every later picture is left out instead of failing the report."""

    def __init__(self) -> None:
        self.enabled = dot_available()

    def svg(self, digraph) -> Optional[str]:
        if not self.enabled:
            return None
        try:
            return to_svg(digraph)
        except DotMissingError:
            self.enabled = False
            return None


def _kv_table(d: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(fmt_kv(k, v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _diff_html(diff: GraphDiff, sid: str, pictures: _Pictures) -> str:
    parts = [f"<p><b>{_e(diff.summary())}</b></p>"]
    if diff.empty and diff.op_delta.empty:
        return parts[0]
    if not diff.op_delta.empty:
        parts.append("<h4>Op counts</h4>" + packed(diff.op_delta.to_html(index=False, classes="diff-ops")))
    table = diff.nodes
    if len(table) > MAX_DIFF_ROWS:
        parts.append(f'<p class="note">first {MAX_DIFF_ROWS} of {len(table)} changed nodes</p>')
        table = table.head(MAX_DIFF_ROWS)
    parts.append(
        '<h4>Changed nodes</h4><div class="scroll">'
        + packed(table.to_html(index=False, classes="diff-table", na_rep=""))
        + "</div>"
    )
    if not diff.empty:
        parts.append(_diff_picture(diff, sid, pictures))
    return "\n".join(parts)


def _graph_div(svg: str, gid: str, cls: str = "graph") -> str:
    """A graph picture, packed when large, with an "open full size" link the script fills in."""
    return (
        f'<div class="{cls}" id="{gid}">{packed(inline_svg(svg, gid + "-"))}</div>'
        f'<p><a class="open-svg" data-for="{gid}" target="_blank" hidden>open full size</a></p>'
    )


def _diff_picture(diff: GraphDiff, sid: str, pictures: _Pictures) -> str:
    """The diff render with 2 hops of context, else with none, else a note saying why not."""
    reason = ""
    for hops in DIFF_HOPS:
        try:
            svg = pictures.svg(render_diff(diff, hops=hops))
        except GraphTooLargeError as e:
            reason = str(e).splitlines()[0].split(", above")[0]
            continue
        if svg is None:
            return '<p class="note">no diff picture: the graphviz dot binary is missing</p>'
        return f"<h4>Diff picture ({hops} hops of context)</h4>" + _graph_div(svg, f"{sid}-diff", "graph diff-graph")
    hint = " The collapsed graph below outlines the layers with new nodes." if diff.names(*NEW_CHANGES) else ""
    return f'<p class="note">no diff picture: {_e(reason)}, too many to lay out.{hint}</p>'


def _first_graph_html(snap: Snapshot) -> str:
    hist = pd.DataFrame(list(snap.op_histogram.items())[:20], columns=["op", "count"])
    return f"<p><b>first graph: {snap.num_nodes} nodes</b> (most frequent ops)</p>" + hist.to_html(
        index=False, classes="op-histogram"
    )


def _marks(diff: Optional[GraphDiff]) -> Dict[str, str]:
    """Node name -> added/modified, for highlighting the collapsed render."""
    if diff is None:
        return {}
    new = diff.nodes[diff.nodes["change"].isin(NEW_CHANGES)]
    return {name: "modified" if c == "modified" else "added" for name, c in zip(new["name"], new["change"])}


def _nav(snap: Snapshot, prev: Optional[Snapshot], nxt: Optional[Snapshot]) -> str:
    links = ['<a href="#top">summary</a>']
    if prev is not None:
        links.insert(0, f'<a class="prev" href="#{section_id(prev.index)}">&larr; #{prev.index:02d} {_e(prev.key)}</a>')
    if nxt is not None:
        links.append(f'<a class="next" href="#{section_id(nxt.index)}">#{nxt.index:02d} {_e(nxt.key)} &rarr;</a>')
    return f'<nav class="steplinks">{" ".join(links)}</nav>'


def _numerics(snap: Snapshot) -> Dict[str, Any]:
    n = snap.numerics
    if n is None:
        return {"probe": "off"}
    if not n.ok:
        return {"error": n.error}
    out: Dict[str, Any] = {"max_abs": n.max_abs, "rmse_ratio": n.rmse_ratio, "top1_agreement": n.top1_agreement}
    if n.carried_from:
        out["carried from"] = f"{n.carried_from} (the graph did not change)"
    if n.from_cache:
        out["from"] = "the probe cache (an earlier run probed this graph with the same weights and code)"
    return out


def _details_grid(snap: Snapshot, timing: Dict[str, Any], memory: Dict[str, Any]) -> str:
    mem_note = f'<p class="warn">unexpected memory change: {_e(snap.mem_warning)}</p>' if snap.mem_warning else ""
    return f"""<div class="grid">
<div><h3>Config</h3><pre>{_e(snap.config.model_dump_json(indent=2))}</pre></div>
<div><h3>Info</h3><pre>{_e(snap.info.model_dump_json(indent=2))}</pre></div>
<div><h3>Timing</h3>{_kv_table(timing)}</div>
<div><h3>Memory</h3>{mem_note}{_kv_table(memory)}</div>
<div><h3>Numerics</h3>{_kv_table(_numerics(snap))}</div>
</div>"""


def _folded_section(snap: Snapshot, nav: str, timing: Dict[str, Any], memory: Dict[str, Any]) -> str:
    """A transform that changed nothing: one line, opening to its config, info and numbers."""
    why = snap.info.skip_reason or "no match"
    return f"""
<section class="step folded" id="{section_id(snap.index)}" data-key="{_e(snap.key)}">
<details><summary>#{snap.index:02d} <b>{_e(snap.key)}</b> <span class="stage">[{_e(snap.stage.value)}]</span>
<span class="status-{_e(snap.status)}">{_e(snap.status)}</span> &middot; changed nothing on this model ({_e(why)})</summary>
{nav}
{_details_grid(snap, timing, memory)}
</details>
</section>"""


def _section(
    snap: Snapshot,
    prev: Optional[Snapshot],
    nav: str,
    diff: Optional[GraphDiff],
    graph: str,
    timing: Dict[str, Any],
    memory: Dict[str, Any],
    pictures: _Pictures,
) -> str:
    sid = section_id(snap.index)
    if diff is not None:
        changes = _diff_html(diff, sid, pictures)
    else:
        changes = _first_graph_html(snap) if prev is None else '<p class="note">no graph kept</p>'
    note = note_of(snap)
    return f"""
<section class="step" id="{sid}" data-key="{_e(snap.key)}">
<h2>#{snap.index:02d} {_e(snap.key)} <span class="stage">[{_e(snap.stage.value)}]</span>
<span class="status-{_e(snap.status)}">{_e(snap.status)}</span></h2>
{nav}
{f'<p class="note">{_e(note)}</p>' if note else ""}
{_details_grid(snap, timing, memory)}
<h3>Changes{f" vs #{prev.index:02d} {_e(prev.key)}" if prev is not None else ""}</h3>
{changes}
<h3>Graph (collapsed; new nodes' layers outlined green)</h3>
{graph}
</section>"""


def _graph_html(
    snap: Snapshot, diff: Optional[GraphDiff], drawn: Optional[Snapshot], pictures: _Pictures, out: Path
) -> Tuple[str, bool]:
    """(html, drawn here) for the snapshot's collapsed render. A graph that did not change since the
    last drawn snapshot points to that render: each render is stored once."""
    if snap.module is None:
        return '<p class="note">no graph kept for this snapshot</p>', False
    if diff is not None and diff.empty and drawn is not None:
        return (
            f'<p class="note">the graph did not change: see its render at '
            f'<a href="#{section_id(drawn.index)}-graph">#{drawn.index:02d} {_e(drawn.key)}</a></p>',
            False,
        )
    digraph = render_snapshot(snap, collapsed=True, marks=_marks(diff))
    svg = pictures.svg(digraph)
    if svg is None:  # no dot here: the source, for a machine that has it
        (out / "dot").mkdir(exist_ok=True)
        src_file = f"dot/{source_name(snap)}"
        (out / src_file).write_text(digraph.source, encoding="utf-8")
        return (
            f'<p class="note" id="{section_id(snap.index)}-graph">no picture: the graphviz dot binary is missing; '
            f'its Graphviz source is <a href="{_e(src_file)}">{_e(src_file)}</a> (<code>dot -Tsvg FILE -O</code>)</p>',
            True,
        )
    return _graph_div(svg, f"{section_id(snap.index)}-graph"), True


def _sharding_html(snaps: List[Snapshot], pictures: _Pictures) -> str:
    """The plan table and one sharded layer's render, when the run was sharded."""
    applied = [s for s in snaps if plan_of(s) is not None and plan_of(s).applied and s.module is not None]
    if not applied:
        return ""
    snap = applied[0]
    plan = plan_of(snap)
    whole, local = plan.bytes()
    table = plan.table().to_html(index=False, classes="plan", border=0, na_rep="")
    try:
        svg = pictures.svg(render_sharded_layer(snap))
        if svg is None:
            picture = '<p class="note">no layer render: the graphviz dot binary is missing</p>'
        else:
            picture = _graph_div(svg, "sharding-graph")
    except (ValueError, GraphTooLargeError) as e:
        picture = f'<p class="note">no layer render: {_e(e)}</p>'
    return f"""
<section id="sharding">
<h2>Sharding plan: rank {plan.rank} of {plan.world_size}</h2>
<p>{len(plan.sharded)} regions split, {len(plan.regions) - len(plan.sharded)} replicated; the split regions' weights:
{whole / 2**20:.2f} MiB whole, {local / 2**20:.2f} MiB on this rank.</p>
<div class="scroll">{table}</div>
<h3>One sharded layer (borders: blue column, green row, red collectives)</h3>
{picture}
</section>"""


def _group_folded(sections: List[Tuple[Snapshot, bool, str]]) -> str:
    """The sections in order, each run of consecutive transforms that changed nothing folded into
    one line that opens to them (one line each)."""
    parts: List[str] = []
    run: List[Tuple[Snapshot, bool, str]] = []

    def flush() -> None:
        if not run:
            return
        first, last = run[0][0], run[-1][0]
        span = f"#{first.index:02d}" if first is last else f"#{first.index:02d}&ndash;#{last.index:02d}"
        parts.append(
            f'<details class="folded-run"><summary>{span}: {len(run)} transform{"s" if len(run) > 1 else ""} '
            f"changed nothing on this model</summary>{''.join(h for _, _, h in run)}</details>"
        )
        run.clear()

    for item in sections:
        if item[1]:
            run.append(item)
            continue
        flush()
        parts.append(item[2])
    flush()
    return "".join(parts)


def write_report(
    stepper: Any, out_dir: Union[str, Path], *, title: Optional[str] = None, warn_no_dot: bool = True
) -> Path:
    """Write ``out_dir/index.html`` for ``stepper``'s snapshots (one file; ``out_dir/dot/*.dot`` too
    when there is no ``dot``).

    ``stepper`` is a ``Workbench``/``PipelineStepper`` (anything with ``.snapshots``); it is only
    read. Returns the path of ``index.html``. Without graphviz's ``dot`` binary the pictures are left
    out (the report says so at the top; ``out_dir/dot/*.dot`` hold the graphs' sources) and, unless
    ``warn_no_dot`` is False (a caller that said so already), a warning says it once.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    snaps: List[Snapshot] = list(stepper.snapshots)
    model = getattr(stepper, "loaded", None)
    title = title or f"workbench report: {getattr(model, 'spec', None) or 'pipeline'}"
    pictures = _Pictures()
    folded = folded_flags(snaps)

    timing = timing_frame(snaps).drop(columns=["transform", "stage", "status"]).set_index("#")
    memory = memory_frame(snaps).drop(columns=["transform"]).set_index("#")
    sections: List[Tuple[Snapshot, bool, str]] = []  # (snapshot, folded, html)
    drawn: Optional[Snapshot] = None  # the last snapshot whose graph was drawn
    archive = ExplorerArchive(out)  # the Model Explorer files of the drawn graphs, packed in one zip
    try:
        for i, snap in enumerate(snaps):
            prev = snaps[i - 1] if i else None
            nxt = snaps[i + 1] if i + 1 < len(snaps) else None
            nav = _nav(snap, prev, nxt)
            t, m = timing.loc[snap.index].to_dict(), memory.loc[snap.index].to_dict()
            if folded[i]:
                sections.append((snap, True, _folded_section(snap, nav, t, m)))
                continue
            diff = None
            if prev is not None and prev.module is not None and snap.module is not None:
                diff = diff_snapshots(prev, snap)
            graph, here = _graph_html(snap, diff, drawn, pictures, out)
            if here:
                drawn = snap
                probed = {s.key: s.numerics for s in snaps[: i + 1] if s.numerics is not None}
                graph += explorer_links(snap, prev, archive, probed)  # the files Model Explorer opens
            sections.append((snap, False, _section(snap, prev, nav, diff, graph, t, m, pictures)))
        archive.close()
    except BaseException:
        archive.discard()  # no half-written zip beside an older index.html
        raise

    chart = ""
    if snaps:
        png = base64.b64encode(figure_png(plot_pipeline(snaps))).decode()
        chart = (
            '<div class="chart" title="click: full size / fit the page">'
            f'<img alt="time, nodes and memory per transform" src="data:image/png;base64,{png}"></div>'
        )
    sharding = _sharding_html(snaps, pictures)
    no_dot_html = ""
    if not pictures.enabled:
        no_dot_html = f'<p class="warn" id="no-pictures">{_e(report_notice_html())}</p>'
        if warn_no_dot:
            warn_once("report-no-dot", report_notice())
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{CSS}</style></head>
<body id="top" data-num-steps="{len(snaps)}">
<h1>{_e(title)}</h1>
{no_dot_html}{missing_note()}{archive_note(archive)}
{summary_html(summary_rows(stepper, snaps, folded))}
<h2>Pipeline</h2>
<div class="scroll" style="max-height:none">{pipeline_table(snaps, folded)}</div>
{sharding}
<h2 id="charts">Time, nodes, memory</h2>
{chart}
{_group_folded(sections)}
<script>{UNPACK_JS}</script>
</body></html>
"""
    path = out / "index.html"
    partial = out / ".index.html.partial"
    try:
        partial.write_text(doc, encoding="utf-8")
        os.replace(partial, path)  # whole or not at all: a full disk leaves no truncated index.html
    finally:
        partial.unlink(missing_ok=True)
    return path
