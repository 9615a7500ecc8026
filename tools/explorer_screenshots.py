"""Model Explorer's pictures, from a real run: the snapshot of ``fuse_gemms`` in Model Explorer.

    .venv/bin/python tools/explorer_screenshots.py                  # smollm2, into docs/images/
    .venv/bin/python tools/explorer_screenshots.py --model tiny:llama --out /tmp/shots

One pipeline run (up to ``fuse_gemms``, numerics on) in this process, then three Model Explorer
servers over its snapshots (``workbench.viz.explorer.serve_snapshots``, what ``wb.explore`` and
``workbench explore`` start) and headless Chromium (the system one, driven by playwright, as in
``tests/test_explorer_browser.py``) at 1400 x 900:

* ``explorer_layers.png``  -- the top level: every decoder layer one collapsed group, painted by the
  ``fuse_gemms`` changes overlay; the side panel lists the layers with their share of the overlay;
* ``explorer_fused.png``   -- layer 0's attention opened and zoomed to the fused Q/K/V GEMM (clicked in
  the node-data table, filtered to its op): green are the nodes ``fuse_gemms`` made;
* ``explorer_compare.png`` -- ``load_weights`` and ``fuse_gemms`` side by side, layer 0's attention
  opened in both: the three Q/K/V GEMMs removed (red, left), the fused one added (green, right).

Each PNG is reduced to a 256-colour palette (``readme_screenshots.shrink``). Needs the explorer and
notebooks extras (Model Explorer, playwright) and Chromium; about 2 minutes for smollm2 on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from readme_screenshots import CHROMIUM_FLAGS, HEIGHT, WIDTH, shrink  # noqa: E402  (tools/, beside this file)


def _fused_gemm(wb, layer: int = 0) -> Optional[str]:
    """Name of layer ``layer``'s fused Q/K/V GEMM (the first node fuse_gemms made there that computes)."""
    from workbench.viz.collapse import assign_layers
    from workbench.viz.provenance import created_by, replaces

    snap = wb.snapshot("fuse_gemms")
    layers = assign_layers(snap.module)
    for node in snap.module.graph.nodes:
        if node.op == "call_function" and created_by(node) == "fuse_gemms" and replaces(node) and layers[node] == layer:
            return node.name
    return None


def _shoot(page, url: str, path: Path, wait_for: str, select_label: str = "") -> int:
    page.goto(url)
    try:
        page.locator(".run-name", has_text=wait_for).first.wait_for(timeout=60_000)
        if select_label:  # click the node in the node-data table (its first row with that label, filtered
            # by the table's regex box): the viewer zooms to it
            page.locator("table.children-stats-results tbody tr").first.wait_for(timeout=120_000)
            page.wait_for_timeout(5000)  # the expanded layer's layout keeps the page busy a while
            page.locator("input[placeholder='regex to filter nodes']").last.fill(f"^{select_label}$", timeout=180_000)
            page.wait_for_timeout(1000)
            page.locator("table").last.locator("tbody tr td.node-label").first.click(timeout=180_000)
    except Exception:
        page.screenshot(path=str(path.with_suffix(".failed.png")))
        raise
    page.wait_for_timeout(5000)  # the layout settles (and zooms)
    page.screenshot(path=str(path), timeout=180_000)  # two 1,250-node panes: slow on a busy CPU
    return shrink(path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(REPO / "docs" / "images"))
    args = ap.parse_args(argv)

    from report_support import find_chromium

    from workbench import Workbench
    from workbench.viz.explorer import serve_snapshots
    from workbench.viz.explorer.convert import node_label

    chromium = find_chromium()
    if chromium is None:
        print("error: no Chromium (install the Debian package 'chromium')", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wb = Workbench(args.model)
    wb.run_to("fuse_gemms")
    print(f"pipeline to fuse_gemms: {time.perf_counter() - t0:.0f}s")
    attn = ["layers.0/self_attn/q_proj"]
    gemm = _fused_gemm(wb) or ""
    label = node_label(next(n for n in wb.snapshot("fuse_gemms").module.graph.nodes if n.name == gemm)) if gemm else ""
    views = [
        ("explorer_layers.png", serve_snapshots(wb.snapshots, wb.keys, "fuse_gemms"), "changes by fuse_gemms"),
        (
            "explorer_fused.png",
            serve_snapshots(wb.snapshots, wb.keys, "fuse_gemms", expand=attn, select=gemm),
            "changes by fuse_gemms",
        ),
        (
            "explorer_compare.png",
            serve_snapshots(wb.snapshots, wb.keys, "fuse_gemms", "load_weights", expand=attn),
            "removed by fuse_gemms",
        ),
    ]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        for name, server, wait_for in views:
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})  # a fresh app per view
            size = _shoot(
                page, server.url, out / name, wait_for, select_label=label if name == "explorer_fused.png" else ""
            )
            print(f"{out / name}: {size // 1024} KB")
            page.close()
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
