"""The pan/zoom/search graph viewer of the panel's Graph and Diff panes, in headless Chromium (the
system one, driven by playwright): the buttons, the wheel, a drag and the search move the SVG's
viewBox as a user expects. The page is opened from a file, so no JupyterLab is needed here (the
quickstart browser test shows it inside the live panel)."""

import re

import pytest
import torch
from report_support import find_chromium

from workbench.viz import render_graph, to_svg
from workbench.viz.svg_viewer import page_of_viewer, svg_viewer_iframe, svg_viewer_page

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


class Chain(torch.nn.Module):
    """A tall, narrow graph (like a collapsed decoder stack): 40 ops in one column."""

    def forward(self, x):
        for i in range(20):
            x = torch.relu(x * (i + 2)) + 1
        return x


def _svg() -> str:
    return to_svg(render_graph(torch.fx.symbolic_trace(Chain())))


def _view_box(page) -> list:
    return [float(v) for v in page.get_attribute("#view svg", "viewBox").split()]


def test_the_viewer_page_keeps_the_svg_and_refuses_text_that_is_not_one():
    svg = _svg()
    page = svg_viewer_page(svg)
    assert page.count("<svg") == 1 and "<?xml" not in page and "relu_19" in page
    assert page_of_viewer(svg_viewer_iframe(svg)) == page  # what the pane shows, read back
    with pytest.raises(ValueError, match="no <svg element"):
        svg_viewer_page("dot failed")


def test_zoom_pan_and_search_in_chromium(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("headless Chromium not found: install the Debian package 'chromium' (`make system-deps`)")
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the notebooks extra")
    html = tmp_path / "viewer.html"
    html.write_text(svg_viewer_page(_svg()))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 500})
            page.goto(html.as_uri())
            x, y, w, h = _view_box(page)
            # First view: the graph's width, not enlarged past 100 %, from its top.
            assert page.inner_text("#zoom") == "100%" and w == pytest.approx(900, abs=2)
            page.click("#fit")  # the whole column fits: zoomed out below 100 %
            fit = int(page.inner_text("#zoom").rstrip("%"))
            assert fit < 100 and _view_box(page)[3] > h
            page.click("#in")
            assert abs(int(page.inner_text("#zoom").rstrip("%")) - fit * 1.25) <= 1
            page.click("#one")
            assert page.inner_text("#zoom") == "100%"
            before = _view_box(page)
            page.mouse.move(450, 300)
            page.mouse.wheel(0, -400)  # wheel up: zoom in around the pointer
            page.wait_for_function("document.getElementById('zoom').textContent !== '100%'")
            zoomed = _view_box(page)
            assert zoomed[2] < before[2]
            page.mouse.move(400, 300)
            page.mouse.down()
            page.mouse.move(300, 200, steps=5)  # drag up-left: the view moves down-right over the graph
            page.mouse.up()
            dragged = _view_box(page)
            assert dragged[0] > zoomed[0] and dragged[1] > zoomed[1] and dragged[2] == pytest.approx(zoomed[2])
            page.fill("#search", "relu_1")  # relu_1 and relu_10 ... relu_19
            assert page.inner_text("#found") == "11 found"
            assert page.locator("g.node.hit").count() == 11
            page.press("#search", "Enter")
            assert re.fullmatch(r"1 of 11", page.inner_text("#found"))
            page.fill("#search", "")
            assert page.locator("g.hit").count() == 0 and page.inner_text("#found") == ""
        finally:
            browser.close()
