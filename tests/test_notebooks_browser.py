"""The quickstart notebook in a real browser: JupyterLab on 127.0.0.1, headless Chromium driven by
playwright (the system Chromium, nothing downloaded), Run All Cells, then the panel must be there
(its buttons and the graph SVG in the DOM) and answer clicks through the live kernel."""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from report_support import find_chromium

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"
ARTIFACTS = REPO / "artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Render every cell (no windowing, so each prompt is in the DOM) and do not ask about news.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
}
# Buttons (ipywidgets draws their text with an ellipsis when it does not fit) whose text is cut.
CUT_LABELS_JS = """() => [...document.querySelectorAll('.wb-panel button')]
  .filter(b => b.offsetParent !== null && b.scrollWidth > b.clientWidth + 1).map(b => b.textContent.trim())"""
RUN_ALL_TIMEOUT_MS = 300_000  # JupyterLab start, kernel start, and the notebook on tiny:llama


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free port with a known token, rooted in a temp dir holding a copy of
    the quickstart; every Jupyter dir points into tmp_path, so no user state is read or written."""
    pytest.importorskip("jupyterlab", reason="needs the notebooks extra (pip install -e '.[notebooks]')")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root)
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "WORKBENCH_NOTEBOOK_MODEL": "tiny:llama",  # the notebook's small-model switch, for speed
        "HF_HUB_OFFLINE": "1",
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
    }
    for plugin, values in LAB_SETTINGS.items():
        path = tmp_path / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log = open(tmp_path / "jupyterlab.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}",
           # offline: no news feed, no update check, no extension-manager queries
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield base, token
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down with it
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the group this test started, nothing else
            server.wait(10)
        log.close()


def test_quickstart_runs_in_jupyterlab_and_the_panel_renders(lab, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("headless Chromium not found (chromium, chromium-browser, google-chrome on PATH, "
                    "/usr/bin/chromium): install the Debian package 'chromium' (`make system-deps`)")
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the notebooks extra")
    base, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        page = browser.new_page()
        try:
            page.goto(f"{base}/lab/tree/01_quickstart.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            # The kernel is connected once the status bar names it and says Idle.
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            panel = page.locator(".wb-panel")
            panel.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            last_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").last
            page.wait_for_function(  # the last cell has run (its prompt shows a number, not *)
                "el => /\\[\\d+\\]/.test(el.textContent)", arg=last_prompt.element_handle(),
                timeout=RUN_ALL_TIMEOUT_MS)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
                                  ":has-text('Traceback')")
            assert errors.count() == 0, errors.first.inner_text()[:2000]

            for label in ("Step", "Run to selected", "Run all", "Stop", "Rewind", "Reset"):
                assert panel.locator("button", has_text=label).count() >= 1, label
            # 1400 px with JupyterLab's file browser open (its default): no button label is cut
            # ("torch-si..."), and the panes wrap below the pipeline list rather than shrink.
            assert page.locator(".jp-FileBrowser").first.is_visible()
            cut = page.evaluate(CUT_LABELS_JS)
            assert cut == [], f"labels cut short: {cut}"
            graph = panel.frame_locator(".wb-graph iframe.wb-svg-viewer").first
            graph.locator("#view svg").wait_for(timeout=60_000)
            viewer = panel.locator(".wb-graph iframe.wb-svg-viewer").first.bounding_box()
            assert viewer is not None and viewer["width"] > 800 and viewer["height"] > 500
            box0 = graph.locator("#view svg").get_attribute("viewBox")
            graph.locator("#in").click()  # the pan/zoom viewer answers inside the live panel
            assert graph.locator("#view svg").get_attribute("viewBox") != box0
            graph.locator("#search").fill("layers.1")
            assert re.fullmatch(r"[1-9]\d* found", graph.locator("#found").inner_text())
            assert panel.locator(".wb-transform", has_text="match_rmsnorm_pattern").count() == 1

            panel.scroll_into_view_if_needed()
            shot = ARTIFACTS / "notebook_quickstart_panel.png"
            panel.screenshot(path=str(shot))
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            page.screenshot(path=str(ARTIFACTS / "notebook_quickstart_page.png"))

            # Charts: one row per transform, drawn at its own size (940 px), not shrunk to the pane.
            panel.locator(".lm-TabBar-tab", has_text="Charts").first.click()
            chart = panel.locator(".wb-chart").first
            page.wait_for_function("el => el.naturalWidth > 0", arg=chart.element_handle(), timeout=60_000)
            size = chart.evaluate(
                "el => [el.naturalWidth, el.naturalHeight, el.getBoundingClientRect().width,"
                " el.getBoundingClientRect().height]")
            assert size[0] >= 900 and size[2] >= 0.97 * size[0] and size[3] >= 0.97 * size[1], size
            chart.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "notebook_quickstart_charts.png"))
            panel.locator(".lm-TabBar-tab", has_text="Graph").first.click()

            # The panel is live: Reset and Step go through the kernel (jobs run in a thread there).
            panel.locator("button", has_text="Reset").first.click()
            panel.get_by_text("reset to the eager model").wait_for(timeout=60_000)
            panel.locator("button", has_text="Step").first.click()
            panel.get_by_text("ran 1 transform").wait_for(timeout=120_000)
            panel.frame_locator(".wb-graph iframe.wb-svg-viewer").first.locator("svg").wait_for(timeout=60_000)
            assert "1/" in panel.locator("h3").first.inner_text()

            panel.screenshot(path=str(ARTIFACTS / "notebook_quickstart_panel_after_step.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "notebook_quickstart_failure.png"))
            raise
        finally:
            browser.close()
