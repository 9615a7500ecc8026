"""A standalone HTML report of a pipeline run: ``write_report(stepper, out_dir) -> index.html``.

One file that opens from disk with no server and no network: the pipeline table, an overview
chart (inline PNG), and per transform a section with its config, info, timing, memory, numerics,
the diff against the previous snapshot (tables, and the diff picture when it is small enough) and
the collapsed graph render. SVGs are inlined (their ids prefixed per section so they stay unique)
and also written beside the report under ``svg/`` for opening full size. A small inline script
records the rendered size of every graph in ``body[data-svg-sizes]``, which lets a headless
browser test check that the graphs really render.

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
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import pandas as pd

from ..pipeline.snapshot import Snapshot
from .charts import figure_png, memory_frame, plot_pipeline, timing_frame
from .diff import NEW_CHANGES, GraphDiff, diff_snapshots
from .diff_view import render_diff
from .outputs import dot_available, report_notice, report_notice_html, source_name, warn_once
from .render import DotMissingError, render_snapshot, snapshot_svg_name, to_svg
from .select import GraphTooLargeError
from .sharding import plan_of, render_sharded_layer

MAX_DIFF_ROWS = 500
DIFF_HOPS = (2, 0)  # context around a diff picture; less when the picture would be too large
_SVG_PROLOG = re.compile(r"^.*?(?=<svg)", re.S)
_SVG_ID = re.compile(r'(\sid|\shref|\sxlink:href)="(#?)([^"]+)"')

_CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#212121;max-width:1400px}
h1{margin-bottom:4px} h2{border-bottom:2px solid #eee;padding-bottom:4px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5} tr.warn td{background:#ffebee} .warn{color:#c62828;font-weight:bold}
pre{background:#fafafa;border:1px solid #eee;padding:6px;font-size:11px;overflow:auto;max-height:260px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:12px}
.graph{overflow:auto;border:1px solid #eee;margin:8px 0;max-height:900px}
.graph svg{display:block}
.steplinks a{margin-right:14px} .stage{color:#757575;font-size:14px}
.status-done{color:#2e7d32} .status-skipped{color:#757575} .status-failed{color:#c62828}
.note{color:#616161;font-style:italic}
.scroll{max-height:480px;overflow:auto;display:inline-block;max-width:100%}
"""

_MEASURE_JS = """
(function(){
  var out=[];
  document.querySelectorAll('.graph svg').forEach(function(svg){
    var r=svg.getBoundingClientRect();
    out.push({graph: svg.parentElement.id, w: Math.round(r.width), h: Math.round(r.height)});
  });
  document.body.setAttribute('data-svg-sizes', JSON.stringify(out));
})();
"""


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


def inline_svg(svg: str, id_prefix: str) -> str:
    """SVG text fit for inlining: no XML prolog/doctype, ids (and refs to them) made unique."""
    body = _SVG_PROLOG.sub("", svg, count=1)

    def fix(m: re.Match) -> str:
        attr, hash_, value = m.groups()
        if attr.strip() != "id" and not hash_:
            return m.group(0)  # an external link, not a reference to an id
        return f'{attr}="{hash_}{id_prefix}{value}"'

    return _SVG_ID.sub(fix, body)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _kv_table(d: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _section_id(i: int) -> str:
    return f"step-{i:02d}"


def _pipeline_table(snaps: List[Snapshot]) -> str:
    prev, head, rows = 0, None, []
    for s in snaps:
        row = s.row(prev)
        prev = s.num_nodes
        head = head or list(row)
        cells = []
        for k, v in row.items():
            text = f'<a href="#{_section_id(s.index)}">{_e(v)}</a>' if k == "transform" else _e("" if v is None else v)
            cells.append(f"<td>{text}</td>")
        cls = ' class="warn"' if s.mem_warning else ""
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    header = "".join(f"<th>{_e(h)}</th>" for h in head or [])
    return f'<table id="pipeline"><tr>{header}</tr>{"".join(rows)}</table>'


def _diff_html(diff: GraphDiff, sid: str, pictures: _Pictures) -> str:
    parts = [f"<p><b>{_e(diff.summary())}</b></p>"]
    if diff.empty and diff.op_delta.empty:
        return parts[0]
    if not diff.op_delta.empty:
        parts.append("<h4>Op counts</h4>" + diff.op_delta.to_html(index=False, classes="diff-ops"))
    table = diff.nodes
    if len(table) > MAX_DIFF_ROWS:
        parts.append(f'<p class="note">first {MAX_DIFF_ROWS} of {len(table)} changed nodes</p>')
        table = table.head(MAX_DIFF_ROWS)
    parts.append(
        '<h4>Changed nodes</h4><div class="scroll">' + table.to_html(index=False, classes="diff-table") + "</div>"
    )
    if not diff.empty:
        parts.append(_diff_picture(diff, sid, pictures))
    return "\n".join(parts)


def _diff_picture(diff: GraphDiff, sid: str, pictures: _Pictures) -> str:
    """The diff render with 2 hops of context, else with none, else a note saying why not."""
    for hops in DIFF_HOPS:
        try:
            svg = pictures.svg(render_diff(diff, hops=hops))
        except GraphTooLargeError as e:
            reason = str(e).splitlines()[0].split(", above")[0]
            continue
        if svg is None:
            return '<p class="note">no diff picture: the graphviz dot binary is missing</p>'
        return (
            f"<h4>Diff picture ({hops} hops of context)</h4>"
            f'<div class="graph diff-graph" id="{sid}-diff">{inline_svg(svg, sid + "-diff-")}</div>'
        )
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
    links = ['<a href="#top">pipeline</a>']
    if prev is not None:
        links.insert(
            0, f'<a class="prev" href="#{_section_id(prev.index)}">&larr; #{prev.index:02d} {_e(prev.key)}</a>'
        )
    if nxt is not None:
        links.append(f'<a class="next" href="#{_section_id(nxt.index)}">#{nxt.index:02d} {_e(nxt.key)} &rarr;</a>')
    return f'<nav class="steplinks">{" ".join(links)}</nav>'


def _section(
    snap: Snapshot,
    prev: Optional[Snapshot],
    nav: str,
    diff: Optional[GraphDiff],
    svg: Optional[str],
    svg_file: Optional[str],
    timing: Dict[str, Any],
    memory: Dict[str, Any],
    pictures: _Pictures,
) -> str:
    sid = _section_id(snap.index)
    n = snap.numerics
    numerics = (
        {"probe": "off"}
        if n is None
        else (
            {"error": n.error}
            if not n.ok
            else {"max_abs": n.max_abs, "rmse_ratio": n.rmse_ratio, "top1_agreement": n.top1_agreement}
        )
    )
    mem_note = f'<p class="warn">unexpected memory change: {_e(snap.mem_warning)}</p>' if snap.mem_warning else ""
    if diff is not None:
        changes = _diff_html(diff, sid, pictures)
    else:
        changes = _first_graph_html(snap) if prev is None else '<p class="note">no graph kept</p>'
    graph = '<p class="note">no graph kept for this snapshot</p>'
    if svg is not None:
        graph = (
            f'<div class="graph" id="{sid}-graph">{inline_svg(svg, sid + "-")}</div>'
            f'<p><a href="{_e(svg_file)}">open the SVG</a></p>'
        )
    elif svg_file is not None:  # no dot here: the source, for a machine that has it
        graph = (
            f'<p class="note">no picture: the graphviz dot binary is missing; its Graphviz source is '
            f'<a href="{_e(svg_file)}">{_e(svg_file)}</a> (<code>dot -Tsvg FILE -O</code>)</p>'
        )
    return f"""
<section class="step" id="{sid}" data-key="{_e(snap.key)}">
<h2>#{snap.index:02d} {_e(snap.key)} <span class="stage">[{_e(snap.stage.value)}]</span>
<span class="status-{_e(snap.status)}">{_e(snap.status)}</span></h2>
{nav}
<div class="grid">
<div><h3>Config</h3><pre>{_e(snap.config.model_dump_json(indent=2))}</pre></div>
<div><h3>Info</h3><pre>{_e(snap.info.model_dump_json(indent=2))}</pre></div>
<div><h3>Timing</h3>{_kv_table(timing)}</div>
<div><h3>Memory</h3>{mem_note}{_kv_table(memory)}</div>
<div><h3>Numerics</h3>{_kv_table(numerics)}</div>
</div>
<h3>Changes{f" vs #{prev.index:02d} {_e(prev.key)}" if prev is not None else ""}</h3>
{changes}
<h3>Graph (collapsed; new nodes' layers outlined green)</h3>
{graph}
</section>"""


def _sharding_html(snaps: List[Snapshot], out: Path, pictures: _Pictures) -> str:
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
            (out / "svg").mkdir(exist_ok=True)
            (out / "svg" / "sharded_layer.svg").write_text(svg, encoding="utf-8")
            picture = (
                f'<div class="graph" id="sharding-graph">{inline_svg(svg, "sharding-")}</div>'
                '<p><a href="svg/sharded_layer.svg">open the SVG</a></p>'
            )
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


def write_report(
    stepper: Any, out_dir: Union[str, Path], *, title: Optional[str] = None, warn_no_dot: bool = True
) -> Path:
    """Write ``out_dir/index.html`` (+ ``out_dir/svg/*.svg``) for ``stepper``'s snapshots.

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

    timing = timing_frame(snaps).drop(columns=["transform", "stage", "status"]).set_index("#")
    memory = memory_frame(snaps).drop(columns=["transform"]).set_index("#")
    svgs: Dict[int, str] = {}  # id(module) -> svg, for unchanged steps sharing their graph copy
    sections = []
    for i, snap in enumerate(snaps):
        prev = snaps[i - 1] if i else None
        nxt = snaps[i + 1] if i + 1 < len(snaps) else None
        diff = None
        if prev is not None and prev.module is not None and snap.module is not None:
            diff = diff_snapshots(prev, snap)
        svg, svg_file = None, None
        if snap.module is not None:
            svg, svg_file = _graph_file(snap, _marks(diff), svgs, pictures, out)
        sections.append(
            _section(
                snap,
                prev,
                _nav(snap, prev, nxt),
                diff,
                svg,
                svg_file,
                timing.loc[snap.index].to_dict(),
                memory.loc[snap.index].to_dict(),
                pictures,
            )
        )

    chart = ""
    if snaps:
        png = base64.b64encode(figure_png(plot_pipeline(snaps))).decode()
        chart = f'<img alt="time, nodes and memory per transform" src="data:image/png;base64,{png}">'
    total = sum(s.times.total for s in snaps)
    error = getattr(stepper, "last_error", None)
    error_html = f'<p class="warn">stopped at an error: {_e(error)}</p>' if error is not None else ""
    sharding = _sharding_html(snaps, out, pictures)
    no_dot_html = ""
    if not pictures.enabled:
        no_dot_html = f'<p class="warn" id="no-pictures">{_e(report_notice_html())}</p>'
        if warn_no_dot:
            warn_once("report-no-dot", report_notice())
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}</style></head>
<body id="top" data-num-steps="{len(snaps)}">
<h1>{_e(title)}</h1>
{no_dot_html}
<p>model: {_e(model if model is not None else "?")} &middot; {len(snaps)} transforms &middot;
{total:.2f} s in transforms</p>
{error_html}
<h2>Pipeline</h2>
{_pipeline_table(snaps)}
{sharding}
<h2>Time, nodes, memory</h2>
<div class="chart">{chart}</div>
{"".join(sections)}
<script>{_MEASURE_JS}</script>
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


def _graph_file(
    snap: Snapshot, marks: Dict[str, str], svgs: Dict[int, str], pictures: _Pictures, out: Path
) -> Tuple[Optional[str], str]:
    """(svg, file) of the snapshot's collapsed render, written under ``out``: the SVG, or with no
    ``dot`` (None, the Graphviz source's file) so that a machine with graphviz can still draw it."""
    svg = None if marks else svgs.get(id(snap.module))
    if svg is None:
        digraph = render_snapshot(snap, collapsed=True, marks=marks)
        svg = pictures.svg(digraph)
        if svg is None:
            (out / "dot").mkdir(exist_ok=True)
            src_file = f"dot/{source_name(snap)}"
            (out / src_file).write_text(digraph.source, encoding="utf-8")
            return None, src_file
    if not marks:
        svgs[id(snap.module)] = svg
    svg_file = f"svg/{snapshot_svg_name(snap)}"
    (out / "svg").mkdir(exist_ok=True)
    (out / svg_file).write_text(svg, encoding="utf-8")
    return svg, svg_file
