"""The README's pictures, from a real run: the notebook panel, a collapsed render and the HTML report.

    .venv/bin/python tools/readme_screenshots.py                  # smollm2, into docs/images/
    .venv/bin/python tools/readme_screenshots.py --model tiny:llama --out /tmp/shots

One pipeline run does it all, in a Jupyter kernel: a notebook (written to a temp dir) loads the model,
runs the default pipeline (numerics on), writes the HTML report (``write_report``) and the collapsed
render of ``fuse_gemms`` with its new nodes' layers outlined (``render_snapshot(collapsed=True)``),
then shows the panel (``wb.ui()``) with ``fuse_rmsnorm`` selected: the whole panel, its Graph pane
(the viewer's search centred on decoder layer 0, at 100 %) and its Charts pane. JupyterLab runs
on 127.0.0.1 with every Jupyter directory in the temp dir; headless Chromium (the system one, driven
by playwright, as in ``tests/test_notebooks_browser.py``) runs the notebook and takes the
screenshots at 1400 px (the panel with JupyterLab's file browser open). Each PNG is cut to at most 1400 x 900 and reduced to a 256-colour palette,
which keeps it well under 300 KB.

Needs the notebooks extra (jupyterlab, playwright), graphviz's ``dot`` and Chromium. Takes about
5 minutes for smollm2 on a loaded CPU machine, most of it the pipeline with its numerics probes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1400, 900
MAX_BYTES = 300_000
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
}
RUN_TIMEOUT_MS = 1_200_000  # the pipeline with numerics probes on a loaded CPU

NOTEBOOK_CELLS = [
    """import os
from pathlib import Path

from workbench import Workbench
from workbench.viz import diff_snapshots, render_snapshot, to_svg
from workbench.viz.report import write_report

OUT = Path(os.environ["WB_SHOTS_DIR"])
wb = Workbench(os.environ["WB_SHOTS_MODEL"])
wb.run()
write_report(wb, OUT / "report")""",
    """snap = wb.snapshot("fuse_gemms")
diff = diff_snapshots(wb.snapshots[snap.index - 1], snap)
new = diff.nodes[diff.nodes["change"].isin(("added", "replacement", "modified"))]
marks = {n: "modified" if c == "modified" else "added" for n, c in zip(new["name"], new["change"])}
(OUT / "collapsed.svg").write_text(to_svg(render_snapshot(snap, collapsed=True, marks=marks)))""",
    """panel = wb.ui()
panel.select("fuse_rmsnorm")
panel""",
]


def _find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    sys.exit("error: headless Chromium not found: install the Debian package 'chromium' (`make system-deps`)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook() -> dict:
    cells = [
        {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
        for i, src in enumerate(NOTEBOOK_CELLS)
    ]
    return {
        "cells": cells,
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


class _Lab:
    """JupyterLab on a free port of 127.0.0.1, rooted in ``tmp/root``; every Jupyter dir in ``tmp``."""

    def __init__(self, tmp: Path, model: str, shots: Path) -> None:
        self.tmp, self.root = tmp, tmp / "root"
        self.root.mkdir()
        (self.root / "shots.ipynb").write_text(json.dumps(_notebook(), indent=1))
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.env = {
            **os.environ,
            "WB_SHOTS_MODEL": model,
            "WB_SHOTS_DIR": str(shots),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        }
        for plugin, values in LAB_SETTINGS.items():
            path = tmp / "settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def __enter__(self) -> str:
        self.log = open(self.tmp / "jupyterlab.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ]
        self.server = subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True
        )
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={self.token}", timeout=2)
                break
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    sys.exit("error: JupyterLab did not start:\n" + (self.tmp / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        return f"{base}/lab/tree/shots.ipynb?token={self.token}"

    def __exit__(self, *exc: object) -> None:
        self.server.send_signal(signal.SIGTERM)  # the server shuts its kernel down with it
        try:
            self.server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)  # the group this script started, nothing else
            self.server.wait(10)
        self.log.close()


def shrink(png: Path, max_bytes: int = MAX_BYTES) -> int:
    """Cut ``png`` to at most WIDTH x HEIGHT and store it with a 256-colour palette; returns its size."""
    from PIL import Image

    with Image.open(png) as im:
        im = im.convert("RGB")
        im = im.crop((0, 0, min(im.width, WIDTH), min(im.height, HEIGHT)))
        for colors in (256, 128, 64):
            im.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
                png, optimize=True
            )
            if png.stat().st_size <= max_bytes:
                break
    return png.stat().st_size


@contextlib.contextmanager
def _browser(chromium: str, profile: Path) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": WIDTH, "height": HEIGHT},
        )
        try:
            yield browser
        finally:
            browser.close()


# Scrolls the scroll box around ``root``'s render so that the box of decoder layer 0 is near its top
# left: a 30-layer render is taller than any screen, and its first lines are the inputs.
SHOW_LAYER0_JS = """(sel) => {
  const root = document.querySelector(sel);
  const title = [...root.querySelectorAll('g.node > title')].find(t => t.textContent.trim() === 'layers.0');
  if (!title) return false;
  const node = title.parentElement;
  let box = node.closest('svg').parentElement;
  while (box && !(box.scrollHeight > box.clientHeight + 1 && getComputedStyle(box).overflowY !== 'visible')) {
    box = box.parentElement;
  }
  box = box || document.scrollingElement;
  if (box !== document.scrollingElement) {  // as wide as what shows of it: a clipping ancestor may be narrower
    let right = window.innerWidth;
    for (let a = box.parentElement; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== 'visible') right = Math.min(right, a.getBoundingClientRect().right);
    }
    box.style.width = (right - box.getBoundingClientRect().left - 8) + 'px';
  }
  const r = node.getBoundingClientRect(), b = box === document.scrollingElement
    ? {top: 0, left: 0, width: window.innerWidth} : box.getBoundingClientRect();
  box.scrollTop += r.top - b.top - 220;
  box.scrollLeft += r.left - b.left - 60;
  return true;
}"""


def run_notebook(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.frame_locator(".wb-panel .wb-graph iframe").first.locator("svg").wait_for(timeout=RUN_TIMEOUT_MS)
    errors = page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Traceback')"
    )
    if errors.count():
        raise RuntimeError("the notebook failed:\n" + errors.first.inner_text()[:3000])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="the model to run (default: smollm2)")
    ap.add_argument("--out", default=str(REPO / "docs" / "images"), help="where the PNGs go (default: docs/images)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chromium = _find_chromium()
    with tempfile.TemporaryDirectory(prefix="wb-shots-") as tmp_name:
        tmp = Path(tmp_name)
        shots = tmp / "shots"
        shots.mkdir()
        t0 = time.perf_counter()
        with _Lab(tmp, args.model, shots) as url:
            with _browser(chromium, tmp / "profile") as browser:
                # The panel: the notebook runs the pipeline, writes the report and the render, shows it.
                # At 1400 px with JupyterLab's file browser open (its default), the panes wrap below
                # the pipeline list at full width.
                page = browser.new_page()
                page.set_viewport_size({"width": WIDTH, "height": HEIGHT + 100})
                try:
                    run_notebook(page, url)
                    panel = page.locator(".wb-panel")
                    panel.scroll_into_view_if_needed()
                    time.sleep(1)  # the panel's last redraw
                    panel.screenshot(path=str(out / "panel.png"))
                    panes = panel.locator(".wb-panes")
                    graph = panes.frame_locator(".wb-graph iframe").first
                    graph.locator("#search").fill("layers.0")  # the viewer's search centres decoder layer 0
                    graph.locator("#search").press("Enter")
                    graph.locator("#one").click()
                    panes.scroll_into_view_if_needed()
                    panes.screenshot(path=str(out / "panel_graph.png"))
                    panes.locator(".lm-TabBar-tab", has_text="Charts").first.click()
                    panes.locator(".wb-chart").first.wait_for()
                    time.sleep(1)
                    panes.screenshot(path=str(out / "panel_charts.png"))
                except Exception:
                    page.screenshot(path=str(tmp / "failure.png"))
                    shutil.copy(tmp / "failure.png", out / "readme_screenshots_failure.png")
                    raise
                print(f"panel: {time.perf_counter() - t0:.0f}s")

                # The collapsed render, scaled to the page width.
                svg_page = shots / "collapsed.html"
                svg_page.write_text(
                    "<!DOCTYPE html><html><body style='margin:0;background:white'>"
                    "<style>svg{display:block;max-width:100%;height:auto}</style>"
                    + (shots / "collapsed.svg").read_text().split("?>", 1)[-1]
                    + "</body></html>"
                )
                page = browser.new_page()
                page.goto(svg_page.as_uri())
                page.evaluate(SHOW_LAYER0_JS, "body")
                page.screenshot(path=str(out / "collapsed_render.png"))

                # The report's top: the summary, the pipeline table with the folded transforms.
                page = browser.new_page()
                page.goto((shots / "report" / "index.html").as_uri())
                page.wait_for_selector("body[data-ready]", timeout=120_000)
                page.screenshot(path=str(out / "report.png"))
    for name in ("panel.png", "panel_graph.png", "panel_charts.png", "collapsed_render.png", "report.png"):
        size = shrink(out / name)
        print(f"{out / name}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
