"""The HTML report in a real browser: the tiny:llama report opened in headless Chromium (the system
Chromium driven by playwright, nothing downloaded) at 1400 px, its packed blocks unpacked by its own
script, every graph rendered, nothing wider than the page, and a screenshot taken.

Also, without a browser: the report's parts that make it worth sharing -- the summary on top, the
folded transforms, formatted numbers, each render stored once -- on the same report."""

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from report_support import find_chromium, unpacked

from workbench import Workbench
from workbench.viz.report import write_report
from workbench.viz.report_page import PACK_OVER, fmt_error, fmt_fraction, fmt_mib, fmt_seconds, packed

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH = 1400

# Every element whose right edge is past the viewport, unless an ancestor that clips its overflow
# (a scroll box: a wide graph or table scrolls inside it) ends inside the viewport.
OVERFLOW_JS = """() => {
  const vw = window.innerWidth, bad = [];
  const clipped = el => {
    for (let a = el.parentElement; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== 'visible' && a.getBoundingClientRect().right <= vw + 0.5) return true;
    }
    return false;
  };
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if ((r.width || r.height) && r.right > vw + 0.5 && !clipped(el)) {
      bad.push(`${el.tagName.toLowerCase()}#${el.id}.${el.getAttribute('class') || ''} right=${Math.round(r.right)}`);
    }
  }
  return {scrollWidth: document.documentElement.scrollWidth, innerWidth: vw, bad: bad.slice(0, 20)};
}"""


class _Sections(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections, self.folded, self.body = [], [], {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "step" in (a.get("class") or ""):
            self.sections.append(a["id"])
            if "folded" in a["class"]:
                self.folded.append(a["data-key"])
        if tag == "body":
            self.body = a


@pytest.fixture(scope="module")
def wb():
    bench = Workbench("tiny:llama")
    bench.run()
    return bench


@pytest.fixture(scope="module")
def report(wb, tmp_path_factory) -> Path:
    return write_report(wb, tmp_path_factory.mktemp("report"))


def test_the_summary_is_on_top_and_the_transforms_that_changed_nothing_are_folded(wb, report):
    from workbench.run_summary import changed_nothing

    html = report.read_text()
    top = html[: html.index('id="pipeline"')]
    for row in ("model", "ran", "pipeline", "memory", "numerics"):
        assert f"<th>{row}</th>" in top, row
    assert "tiny:llama" in top and "attention" in top and "weights " in top and "KV cache" in top
    quiet, prev = [], 0
    for s in wb.snapshots:
        if changed_nothing(s, prev):
            quiet.append(s.key)
        prev = s.num_nodes
    assert len(quiet) > len(wb.snapshots) // 3  # most of the default pipeline on a plain llama
    parser = _Sections()
    parser.feed(html)
    assert parser.sections == [f"step-{s.index:02d}" for s in wb.snapshots]  # every step keeps its anchor
    assert parser.folded == quiet
    table = html[html.index('id="pipeline"'): html.index("</table>", html.index('id="pipeline"'))]
    assert table.count('<tr class="fold">') >= 2  # one line per stage with folded transforms
    assert sum(int(n) for n in re.findall(r"(\d+) transforms? changed nothing", table)) == len(quiet)
    assert 'href="#step-00">export_to_gm</a>' in table and "load_weights" in table


def test_numbers_are_formatted(report):
    html = unpacked(report.read_text())
    assert not re.search(r"\d\.\d{6,}", html.split("<svg")[0]), "a raw float in the tables"
    assert fmt_error(1.7734641915012617e-06) == "1.8e-06" and fmt_error(0.0) == "0"
    assert fmt_seconds(0.22312) == "0.223 s" and fmt_seconds(12.345) == "12.3 s"
    assert fmt_mib(92.14, signed=True) == "+92.1 MiB" and fmt_mib(0.408, signed=True) == "+0.408 MiB"
    assert fmt_fraction(1.0) == "100%" and fmt_fraction(0.9375) == "93.75%"


def test_each_render_is_stored_once(wb, report):
    html = report.read_text()
    assert not (report.parent / "svg").exists()  # no second copy beside the report
    full = unpacked(html)
    graphs = re.findall(r'<div class="graph" id="(step-\d\d)-graph">', full)
    assert graphs[0] == "step-00" and len(graphs) == len(set(graphs))
    assert len(graphs) < len(wb.snapshots) // 2  # the snapshots that changed the graph, not all 60
    assert full.count("the graph did not change: see its render at") >= 1
    for ref in re.findall(r'see its render at <a href="#(step-\d\d)-graph"', full):
        assert ref in graphs  # every pointer lands on a render
    assert "http://" not in full.replace("http://www.w3.org", "") and "https://" not in full  # no network


def test_packed_blocks_round_trip():
    small = "<p>x</p>"
    assert packed(small) == small
    big = "<table>" + "<tr><td>row</td></tr>" * (PACK_OVER // 10) + "</table>"
    block = packed(big)
    assert 'data-z="' in block and len(block) < len(big) / 5
    assert unpacked(block) == big


def test_report_reads_well_in_chromium_at_1400px(wb, report, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("headless Chromium not found (chromium, chromium-browser, google-chrome on PATH, "
                    "/usr/bin/chromium): install the Debian package 'chromium' (`make system-deps`)")
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the notebooks extra")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.goto(report.resolve().as_uri())
            page.wait_for_selector("body[data-ready]", timeout=60_000)  # the script unpacked and measured
            assert page.locator("[data-z]").count() == 0
            assert page.locator(".packed .warn").count() == 0  # nothing failed to unpack
            sizes = json.loads(page.get_attribute("body", "data-svg-sizes"))
            graphs = [s for s in sizes if s["graph"].endswith("-graph")]
            assert graphs and len(graphs) == page.locator("div.graph[id$='-graph']").count()
            assert all(s["w"] > 50 and s["h"] > 50 for s in sizes), sizes
            assert page.locator("a.open-svg[href^='blob:']").count() == len(sizes)  # full size, one click

            shot = tmp_path / "report_1400.png"
            page.screenshot(path=str(shot))
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            ARTIFACTS.mkdir(exist_ok=True)
            shutil.copy(shot, ARTIFACTS / "report_tiny_llama_1400.png")

            layout = page.evaluate(OVERFLOW_JS)
            assert layout["scrollWidth"] <= layout["innerWidth"] == WIDTH, layout
            assert layout["bad"] == [], layout
            chart = page.locator(".chart img").bounding_box()
            assert chart is not None and chart["x"] + chart["width"] <= WIDTH  # the chart scales to the page
            natural = page.evaluate("document.querySelector('.chart img').naturalWidth")
            assert natural > WIDTH  # ... although it is wider: it is scaled down, not cut
            note = page.locator("#pipeline td.note").first.bounding_box()
            assert note is not None and note["x"] + note["width"] <= WIDTH  # the note column is not clipped

            # a folded transform: its line in the table opens to a link that opens its folded section
            fold = page.locator("#pipeline tr.fold summary").first
            fold.click()
            link = page.locator("#pipeline tr.fold a").first
            target = link.get_attribute("href")
            link.click()
            page.wait_for_function("id => document.getElementById(id).closest('details.folded-run').open",
                                   arg=target[1:], timeout=10_000)
            assert page.locator(target).is_visible()
        finally:
            browser.close()
