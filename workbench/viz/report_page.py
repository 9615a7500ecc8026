"""The report page's fixed parts and formats: its CSS, the script that unpacks the compressed blocks
(``packed``), SVG text made fit for inlining, and the number formats of its tables (``fmt_*``).

``workbench.viz.report`` lays the page out from a run's snapshots; what is here knows nothing of
snapshots, only of HTML text and numbers.
"""

from __future__ import annotations

import base64
import gzip
import math
import re
from typing import Any, Optional

PACK_OVER = 16 * 1024  # bytes of HTML above which a block is stored compressed (see report.py's docstring)
_SVG_PROLOG = re.compile(r"^.*?(?=<svg)", re.S)
_SVG_ID = re.compile(r'(\sid|\shref|\sxlink:href)="(#?)([^"]+)"')
_SVG_COMMENT = re.compile(r"<!--.*?-->\n?", re.S)

CSS = """
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
UNPACK_JS = """
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


def fmt_kv(key: str, v: Any) -> str:
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


__all__ = [
    "CSS",
    "UNPACK_JS",
    "PACK_OVER",
    "inline_svg",
    "packed",
    "fmt_seconds",
    "fmt_mib",
    "fmt_error",
    "fmt_fraction",
    "fmt_kv",
]
