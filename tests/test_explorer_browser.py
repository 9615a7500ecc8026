"""Model Explorer in a real browser: ``workbench explore --model smollm2 --at fuse_gemms`` serves the
embedded SmolLM2-135M's snapshot; headless Chromium (the system one, driven by playwright, as in the
other browser tests) loads it and shows 30 collapsible decoder layers at the top level, each holding
nodes that the ``fuse_gemms`` overlay marks, and that overlay paints exactly the fused nodes green.
A screenshot goes to ``artifacts/explorer_smollm2.png``. Slow (~60-90 s: the real model's pipeline
up to ``fuse_gemms`` with its numerics probes, in a ``workbench explore`` process)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from report_support import find_chromium

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FUSED_GREEN = "rgb(102, 187, 106)"  # overlays.CHANGE_COLORS[ADDED], #66bb6a


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_url(proc: subprocess.Popen, timeout_s: float) -> str:
    """The ``Model Explorer: URL`` line ``workbench explore`` prints once it serves."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"workbench explore exited {proc.returncode}:\n{''.join(seen)}")
            continue
        seen.append(line)
        if line.startswith("Model Explorer: "):
            return line.split(": ", 1)[1].strip()
    raise AssertionError(f"no URL within {timeout_s:.0f}s:\n{''.join(seen)}")


def test_model_explorer_shows_smollm2_layers_and_the_fuse_gemms_overlay(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("headless Chromium not found (chromium, chromium-browser, google-chrome on PATH, "
                    "/usr/bin/chromium): install the Debian package 'chromium' (`make system-deps`)")
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the notebooks extra")
    pytest.importorskip("model_explorer", reason="needs the explorer extra (pip install -e '.[explorer]')")

    out = tmp_path / "explorer"
    cmd = [sys.executable, "-m", "workbench.cli", "explore", "--model", "smollm2", "--at", "fuse_gemms",
           "--port", str(_free_port()), "--out", str(out), "--expand", "layers.0/self_attn/q_proj"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        url = _wait_for_url(proc, 400)

        # what the files say: the nodes fuse_gemms made that replaced others, in every layer
        graph = json.loads((out / "39_fuse_gemms.json").read_text())["graphs"][0]
        attrs = {n["id"]: {a["key"]: a["value"] for a in n.get("attrs", [])} for n in graph["nodes"]}
        fused = {i for i, a in attrs.items() if a.get("created_by") == "fuse_gemms" and a.get("replaces")}
        changes = json.loads((out / "39_fuse_gemms.changes.nodedata.json").read_text())
        marked = set(changes["39_fuse_gemms"]["results"])
        assert marked == fused and len(fused) >= 30 * 2  # Q/K/V and gate/up per layer, at least
        spaces = {n["id"]: n["namespace"] for n in graph["nodes"]}
        assert {spaces[i].split("/")[0] for i in fused} == {f"layers.{k}" for k in range(30)}

        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(url)
            page.locator(".run-name", has_text="changes by fuse_gemms").wait_for(timeout=90_000)

            # the top level: 30 decoder layers, each a group (a root-level node that is a layer), each
            # holding marked nodes (its share of the overlay's sum, not "-")
            rows = page.locator("table.children-stats-results tbody tr")
            rows.first.wait_for(timeout=30_000)
            cells = [[c.strip() for c in r.locator("td").all_inner_texts()] for r in rows.all()]
            layers = {c[1]: c[-1] for c in cells if re.fullmatch(r"layers\.\d+", c[1])}
            assert sorted(layers, key=lambda s: int(s.split(".")[1])) == [f"layers.{k}" for k in range(30)]
            assert all(v not in ("-", "", "NaN") for v in layers.values()), layers
            count = re.search(r"layer count\s+(\d+)", page.inner_text("body"))  # GRAPH INFO: every group
            assert count and int(count.group(1)) >= 30

            # the overlay paints the fused nodes: the node-data table filtered to "fused" shows them
            # with the changes value 1 on green
            node_filter = page.locator("input[placeholder='regex to filter nodes']").last
            node_filter.fill("fused")
            page.wait_for_timeout(500)
            table = page.locator("table").last
            fused_rows = table.locator("tbody tr")
            assert fused_rows.count() > 0
            for r in fused_rows.all():
                label, value = r.locator("td").nth(1).inner_text(), r.locator("td").last
                assert "fused" in label
                assert value.inner_text().strip() == "1", label
                assert value.evaluate("e => getComputedStyle(e).backgroundColor") == FUSED_GREEN, label
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "explorer_smollm2.png"))
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
