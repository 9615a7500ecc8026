"""A pan/zoom/search viewer for one dot SVG, as a self-contained HTML page (no network, no libraries).

The panel's Graph and Diff panes and anything else that shows a large render use it: a collapsed
30-layer model is ~4,000 pt tall and a diff picture can be ~18,000 px wide, which a fixed-size
scroll box shows as mostly white space. The page keeps dot's SVG as it is and moves a ``viewBox``
over it:

- wheel zooms around the pointer, drag pans, the toolbar fits the whole graph, fits its width
  (never enlarged past 100 %) or goes to 100 %; the first view is the whole graph where it
  fits at 40 % or more, else its width;
- the search box finds nodes whose label or tooltip contains the text (case-insensitive), outlines
  every match and centres the next one on Enter;
- dot's ``<title>`` elements stay, so hovering a node shows its full name.

``svg_viewer_iframe`` wraps the page in an ``<iframe srcdoc=...>``: a notebook HTML widget's value
is inserted with ``innerHTML``, where a ``<script>`` never runs, but an iframe's document does.
"""

from __future__ import annotations

import html

VIEWER_SCRIPT = r"""
const svg = document.querySelector('#view svg');
const view = document.getElementById('view');
const zoomLabel = document.getElementById('zoom');
const found = document.getElementById('found');
const base = svg.viewBox.baseVal;
const W0 = base.width, H0 = base.height, X0 = base.x, Y0 = base.y;
svg.removeAttribute('width'); svg.removeAttribute('height');
svg.setAttribute('preserveAspectRatio', 'xMinYMin meet');
let scale = 1, x = X0, y = Y0;  // scale: screen px per SVG unit; (x, y): the SVG point at the top left
function size() { return [view.clientWidth || 600, view.clientHeight || 400]; }
function draw() {
  const [cw, ch] = size();
  svg.setAttribute('viewBox', `${x} ${y} ${cw / scale} ${ch / scale}`);
  zoomLabel.textContent = Math.round(scale * 100) + '%';
}
function zoomAt(factor, px, py) {  // keep the SVG point under (px, py) where it is
  const s = Math.min(Math.max(scale * factor, 0.01), 8);
  x += px / scale - px / s; y += py / scale - py / s; scale = s; draw();
}
function fitAll() {
  const [cw, ch] = size();
  scale = Math.min(cw / W0, ch / H0);
  x = X0 - (cw / scale - W0) / 2; y = Y0 - (ch / scale - H0) / 2; draw();
}
function fitWidth() {
  const [cw] = size();
  scale = Math.min(1, cw / W0); x = X0 - Math.max(0, cw / scale - W0) / 2; y = Y0; draw();
}
function firstView() {  // a graph that fits at 40 % or more is shown whole, a taller one by its width
  const [cw, ch] = size();
  if (Math.min(cw / W0, ch / H0) >= 0.4) { fitAll(); if (scale > 1) actual(); } else fitWidth();
}
function actual() { const [cw, ch] = size(); zoomAt(1 / scale, cw / 2, ch / 2); }
document.getElementById('fit').onclick = fitAll;
document.getElementById('width').onclick = fitWidth;
document.getElementById('one').onclick = actual;
document.getElementById('in').onclick = () => { const [cw, ch] = size(); zoomAt(1.25, cw / 2, ch / 2); };
document.getElementById('out').onclick = () => { const [cw, ch] = size(); zoomAt(0.8, cw / 2, ch / 2); };
view.addEventListener('wheel', (e) => {
  e.preventDefault();
  const r = view.getBoundingClientRect();
  zoomAt(Math.pow(1.0015, -e.deltaY), e.clientX - r.left, e.clientY - r.top);
}, {passive: false});
let drag = null;
view.addEventListener('mousedown', (e) => { drag = [e.clientX, e.clientY]; view.classList.add('dragging'); });
window.addEventListener('mouseup', () => { drag = null; view.classList.remove('dragging'); });
window.addEventListener('mousemove', (e) => {
  if (!drag) return;
  x -= (e.clientX - drag[0]) / scale; y -= (e.clientY - drag[1]) / scale; drag = [e.clientX, e.clientY]; draw();
});
let matches = [], at = -1;
function search(text) {
  document.querySelectorAll('g.hit').forEach((g) => g.classList.remove('hit'));
  const q = text.trim().toLowerCase();
  matches = !q ? [] : Array.from(svg.querySelectorAll('g.node, g.cluster')).filter(
    (g) => g.textContent.toLowerCase().includes(q));
  matches.forEach((g) => g.classList.add('hit'));
  at = -1;
  found.textContent = q ? `${matches.length} found` : '';
}
function centreNext() {
  if (!matches.length) return;
  at = (at + 1) % matches.length;
  const box = matches[at].getBoundingClientRect(), r = view.getBoundingClientRect();
  const [cw, ch] = size();
  x += (box.left + box.width / 2 - r.left - cw / 2) / scale;
  y += (box.top + box.height / 2 - r.top - ch / 2) / scale;
  draw();
  found.textContent = `${at + 1} of ${matches.length}`;
}
const input = document.getElementById('search');
input.addEventListener('input', () => search(input.value));
input.addEventListener('keydown', (e) => { if (e.key === 'Enter') centreNext(); });
// In a hidden tab the frame has no size yet: fit when it first gets one.
let sized = view.clientWidth > 0;
window.addEventListener('resize', () => { if (!sized && view.clientWidth > 0) { sized = true; firstView(); } else draw(); });
firstView();
"""

PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><style>
html, body {{ margin: 0; height: 100%; font: 13px sans-serif; }}
#bar {{ height: 30px; display: flex; gap: 4px; align-items: center; padding: 0 6px;
        border-bottom: 1px solid #ddd; background: #fafafa; }}
#bar button {{ font: inherit; padding: 2px 8px; }}
#zoom {{ min-width: 44px; text-align: right; color: #555; }}
#found {{ color: #555; }}
#view {{ position: absolute; top: 31px; bottom: 0; left: 0; right: 0; overflow: hidden; cursor: grab; }}
#view.dragging {{ cursor: grabbing; }}
#view svg {{ width: 100%; height: 100%; display: block; user-select: none; }}
g.hit > polygon, g.hit > ellipse, g.hit > path {{ stroke: #d50000; stroke-width: 4px; }}
</style></head><body>
<div id="bar"><button id="fit" title="the whole graph">fit</button>
<button id="width" title="the graph's width (at most 100 %)">width</button>
<button id="one" title="actual size">100%</button><button id="out" title="zoom out">&minus;</button>
<button id="in" title="zoom in">+</button><span id="zoom"></span>
<input id="search" placeholder="find a node (Enter: next)" size="28"><span id="found"></span>
<span style="margin-left:auto;color:#888">wheel: zoom &middot; drag: pan</span></div>
<div id="view">{svg}</div>
<script>{script}</script></body></html>"""


def svg_viewer_page(svg: str) -> str:
    """A whole HTML page showing ``svg`` (dot's output; its XML prologue is dropped) with pan, zoom
    and search."""
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("svg_viewer_page needs an SVG document (no <svg element in the text given)")
    return PAGE.format(svg=svg[start:], script=VIEWER_SCRIPT)


def svg_viewer_iframe(svg: str, height: int = 640) -> str:
    """``svg_viewer_page`` in an iframe ``height`` px tall that fills its container's width."""
    doc = html.escape(svg_viewer_page(svg), quote=True)
    return (
        f"<iframe class='wb-svg-viewer' srcdoc=\"{doc}\" "
        f"style='width:100%;height:{height}px;border:1px solid #ddd;display:block'></iframe>"
    )


def page_of_viewer(iframe_html: str) -> str:
    """The page inside a ``svg_viewer_iframe`` (for tests and tools that read what the pane shows)."""
    start = iframe_html.find('srcdoc="')
    if start < 0:
        raise ValueError("not a svg_viewer_iframe: no srcdoc attribute")
    end = iframe_html.find('"', start + len('srcdoc="'))
    return html.unescape(iframe_html[start + len('srcdoc="') : end])
