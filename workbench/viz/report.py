"""A standalone HTML report of a pipeline run: ``write_report(stepper, out_dir) -> index.html``.

One file that opens from disk with no server and no network, made to be shared:

* at the top, the run's summary (model, where and how it ran, pipeline time, memory, the worst
  numerics step), then the pipeline table with formatted numbers, where the transforms that changed
  nothing on this model (``run_summary.changed_nothing``) fold into one line per stage, as in
  ``workbench run``'s table;
* an overview chart (inline PNG) that scales to the page width (click it for full size);
* per transform a section: config, info, timing, memory, numerics, the diff against the previous
  snapshot (tables, and the diff picture when it is small enough) and the collapsed graph render.
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
import gzip
import html
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import pandas as pd

from ..pipeline.snapshot import Snapshot
from ..run_summary import changed_nothing
from .charts import figure_png, memory_frame, plot_pipeline, timing_frame
from .diff import NEW_CHANGES, GraphDiff, diff_snapshots
from .diff_view import render_diff
from .outputs import dot_available, report_notice, report_notice_html, source_name, warn_once
from .render import DotMissingError, render_snapshot, to_svg
from .select import GraphTooLargeError
from .sharding import plan_of, render_sharded_layer

MAX_DIFF_ROWS = 500
DIFF_HOPS = (2, 0)  # context around a diff picture; less when the picture would be too large
PACK_OVER = 16 * 1024  # bytes of HTML above which a block is stored compressed (see the module docstring)
_SVG_PROLOG = re.compile(r"^.*?(?=<svg)", re.S)
_SVG_ID = re.compile(r'(\sid|\shref|\sxlink:href)="(#?)([^"]+)"')
_SVG_COMMENT = re.compile(r"<!--.*?-->\n?", re.S)

_CSS = """
*{box-sizing:border-box}
body{font-family:Helvetica,Arial,sans-serif;margin:0 auto;padding:16px 24px;color:#212121;max-width:1400px;
 line-height:1.35}
h1{margin:0 0 8px;font-size:24px;overflow-wrap:anywhere} h2{border-bottom:2px solid #eee;padding-bottom:4px;
 font-size:19px;overflow-wrap:anywhere} h3{font-size:15px;margin:10px 0 4px} h4{margin:8px 0 4px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5} tr.warn td{background:#ffebee} .warn{color:#c62828;font-weight:bold}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
#pipeline{width:100%} #pipeline td.note{overflow-wrap:anywhere;min-width:14em;color:#424242}
#pipeline tr.fold td{background:#fafafa;color:#616161;font-size:11.5px}
#pipeline tr.fold summary{cursor:pointer} #pipeline tr.fold a{margin-right:8px}
table.summary th{width:8em} table.summary td{overflow-wrap:anywhere}
pre{background:#fafafa;border:1px solid #eee;padding:6px;font-size:11px;overflow:auto;max-height:260px;
 white-space:pre-wrap;overflow-wrap:anywhere;margin:0}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:12px}
.grid>div{min-width:0}
.graph{overflow:auto;border:1px solid #eee;margin:8px 0;max-height:900px;max-width:100%}
.graph svg{display:block} .graph:not(.diff-graph) svg{max-width:100%;height:auto}
.chart{max-width:100%;overflow-x:auto} .chart img{display:block;max-width:100%;height:auto;cursor:zoom-in}
.chart.full img{max-width:none;cursor:zoom-out}
.steplinks a{margin-right:14px} .stage{color:#757575;font-size:14px}
.status-done{color:#2e7d32} .status-skipped{color:#757575} .status-failed{color:#c62828}
.note{color:#616161;font-style:italic}
.scroll{max-height:480px;overflow:auto;max-width:100%}
details.folded-run{margin:14px 0;padding:6px 10px;background:#fafafa;border:1px solid #eee;color:#616161}
details.folded-run>summary{cursor:pointer;font-size:14px}
section.folded{border-bottom:1px solid #f0f0f0;padding:2px 0 2px 12px;font-size:13px}
section.folded summary{cursor:pointer;color:#616161} section.folded summary b{color:#212121}
.open-svg{font-size:12px}
"""

# Unpacks the data-z blocks (gzip, base64), then measures every graph and sets body[data-ready].
_UNPACK_JS = """
(function(){
  function measure(){
    var out=[];
    document.querySelectorAll('.graph svg').forEach(function(svg){
      var r=svg.getBoundingClientRect(), g=svg.closest('.graph');
      out.push({graph: g ? g.id : '', w: Math.round(r.width), h: Math.round(r.height)});
      var link=g && g.parentElement.querySelector('a.open-svg[data-for="'+g.id+'"]');
      if(link){
        var blob=new Blob([new XMLSerializer().serializeToString(svg)],{type:'image/svg+xml'});
        link.href=URL.createObjectURL(blob); link.hidden=false;
      }
    });
    document.body.setAttribute('data-svg-sizes', JSON.stringify(out));
    document.body.setAttribute('data-ready', '1');
    if(location.hash) reveal();  // the target moved while the blocks above it unpacked
  }
  async function unpack(el){
    var bytes=Uint8Array.from(atob(el.getAttribute('data-z')), function(c){return c.charCodeAt(0);});
    var stream=new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    el.innerHTML=await new Response(stream).text();
    el.removeAttribute('data-z');
  }
  async function all(){
    var packed=document.querySelectorAll('[data-z]');
    if(packed.length && typeof DecompressionStream==='undefined'){
      packed.forEach(function(el){el.innerHTML='<p class="warn">this browser cannot unpack this block '+
        '(it needs DecompressionStream: Chromium 80+, Firefox 113+, Safari 16.4+)</p>';});
    } else {
      for(var i=0;i<packed.length;i++){ try{ await unpack(packed[i]); }catch(e){
        packed[i].innerHTML='<p class="warn">could not unpack this block: '+e+'</p>'; } }
    }
    measure();
  }
  function reveal(){
    var el=location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    for(var d=el; d; d=d.parentElement){ if(d.tagName==='DETAILS') d.open=true; }
    if(el) el.scrollIntoView();
  }
  window.addEventListener('hashchange', reveal); reveal();
  var chart=document.querySelector('.chart');
  if(chart){ chart.addEventListener('click', function(){ chart.classList.toggle('full'); }); }
  all();
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
    """SVG text fit for inlining: no XML prolog/doctype or comments, ids (and refs to them) made unique."""
    body = _SVG_COMMENT.sub("", _SVG_PROLOG.sub("", svg, count=1))

    def fix(m: re.Match) -> str:
        attr, hash_, value = m.groups()
        if attr.strip() != "id" and not hash_:
            return m.group(0)  # an external link, not a reference to an id
        return f'{attr}="{hash_}{id_prefix}{value}"'

    return _SVG_ID.sub(fix, body)


def packed(block: str) -> str:
    """``block`` as it is when small; above ``PACK_OVER`` bytes, gzip + base64 in a ``data-z``
    element that the report's script unpacks in place (deterministic: no timestamp in the gzip)."""
    if len(block) <= PACK_OVER:
        return block
    z = base64.b64encode(gzip.compress(block.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")
    return f'<div class="packed" data-z="{z}"><p class="note">unpacking&hellip; (needs JavaScript)</p></div>'


# ------------------------------------------------------------------------------ number formats
def fmt_seconds(v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if v == 0:
        return "0"
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def fmt_mib(v: Optional[float], signed: bool = False) -> str:
    """MiB with one decimal (three below 1 MiB); ``signed`` shows a + on growth; exactly 0 is ``0``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if v == 0:
        return "0"
    sign = "+" if signed else ""
    return f"{v:{sign}.1f} MiB" if abs(v) >= 1 else f"{v:{sign}.3f} MiB"


def fmt_error(v: Optional[float]) -> str:
    """A numerics error (max abs, rmse ratio): 2 significant digits in e-notation; exactly 0 is ``0``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return "0" if v == 0 else f"{v:.1e}"


def fmt_fraction(v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:.0%}" if v in (0.0, 1.0) else f"{v:.2%}"


def _fmt_kv(key: str, v: Any) -> str:
    """A value of the timing/memory/numerics tables, formatted by what its key says it is."""
    if isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
        return "" if v is None else str(v)
    if key.endswith("_s"):
        return fmt_seconds(float(v))
    if key.endswith("_MiB"):
        return fmt_mib(float(v), signed=key.startswith("delta"))
    if key in ("max_abs", "rmse_ratio"):
        return fmt_error(float(v))
    if key.startswith("top1"):
        return fmt_fraction(float(v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _kv_table(d: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt_kv(k, v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _section_id(i: int) -> str:
    return f"step-{i:02d}"


def _step_link(s: Snapshot) -> str:
    return f'<a href="#{_section_id(s.index)}">{_e(s.key)}</a>'


# ------------------------------------------------------------------------------ top of the page
def _folded_flags(snaps: List[Snapshot]) -> List[bool]:
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


def _note(s: Snapshot) -> str:
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
    note = _note(s) + (f" (memory: {s.mem_warning})" if s.mem_warning else "")
    cells = [
        _e(s.index),
        _e(s.stage.value),
        _step_link(s),
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


def _pipeline_table(snaps: List[Snapshot], folded: List[bool]) -> str:
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
            links = " ".join(_step_link(q) for q in quiet)
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
                f'<a href="#{_section_id(snap.index)}">#{snap.index:02d} {_e(snap.key)}</a>'
            )
    if failed:
        parts.append(f"{len(failed)} probe(s) could not run, the first at #{failed[0].index:02d} {_e(failed[0].key)}")
    return "; ".join(parts)


def _summary_rows(stepper: Any, snaps: List[Snapshot], folded: List[bool]) -> List[Tuple[str, str]]:
    """The summary of ``workbench run`` as far as it is known when the report is written (before
    generation): model, where and how it runs, the pipeline's time, memory, numerics."""
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
    return rows


def _summary_html(rows: List[Tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="summary" id="summary">{body}</table>'


# ------------------------------------------------------------------------------ sections
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
        links.insert(
            0, f'<a class="prev" href="#{_section_id(prev.index)}">&larr; #{prev.index:02d} {_e(prev.key)}</a>'
        )
    if nxt is not None:
        links.append(f'<a class="next" href="#{_section_id(nxt.index)}">#{nxt.index:02d} {_e(nxt.key)} &rarr;</a>')
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
<section class="step folded" id="{_section_id(snap.index)}" data-key="{_e(snap.key)}">
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
    sid = _section_id(snap.index)
    if diff is not None:
        changes = _diff_html(diff, sid, pictures)
    else:
        changes = _first_graph_html(snap) if prev is None else '<p class="note">no graph kept</p>'
    note = _note(snap)
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
            f'<a href="#{_section_id(drawn.index)}-graph">#{drawn.index:02d} {_e(drawn.key)}</a></p>',
            False,
        )
    digraph = render_snapshot(snap, collapsed=True, marks=_marks(diff))
    svg = pictures.svg(digraph)
    if svg is None:  # no dot here: the source, for a machine that has it
        (out / "dot").mkdir(exist_ok=True)
        src_file = f"dot/{source_name(snap)}"
        (out / src_file).write_text(digraph.source, encoding="utf-8")
        return (
            f'<p class="note" id="{_section_id(snap.index)}-graph">no picture: the graphviz dot binary is missing; '
            f'its Graphviz source is <a href="{_e(src_file)}">{_e(src_file)}</a> (<code>dot -Tsvg FILE -O</code>)</p>',
            True,
        )
    return _graph_div(svg, f"{_section_id(snap.index)}-graph"), True


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
    folded = _folded_flags(snaps)

    timing = timing_frame(snaps).drop(columns=["transform", "stage", "status"]).set_index("#")
    memory = memory_frame(snaps).drop(columns=["transform"]).set_index("#")
    sections: List[Tuple[Snapshot, bool, str]] = []  # (snapshot, folded, html)
    drawn: Optional[Snapshot] = None  # the last snapshot whose graph was drawn
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
        sections.append((snap, False, _section(snap, prev, nav, diff, graph, t, m, pictures)))

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
<title>{_e(title)}</title><style>{_CSS}</style></head>
<body id="top" data-num-steps="{len(snaps)}">
<h1>{_e(title)}</h1>
{no_dot_html}
{_summary_html(_summary_rows(stepper, snaps, folded))}
<h2>Pipeline</h2>
<div class="scroll" style="max-height:none">{_pipeline_table(snaps, folded)}</div>
{sharding}
<h2 id="charts">Time, nodes, memory</h2>
{chart}
{_group_folded(sections)}
<script>{_UNPACK_JS}</script>
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
