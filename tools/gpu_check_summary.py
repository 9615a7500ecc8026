"""summary.md of ``make gpu-check`` (tools/gpu_check.py): the step table, and for the tests step what
tests.log (written by tools/pytest_stream.py as tests finish) says: counts, every failed test by
name, the tests running when the step stopped, those never started, and the skips."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

RESULTS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "crashed")  # pytest_stream's kinds
BAD = ("failed", "error", "crashed")
ALLOWED_SKIPS = ("optional package missing", "could not import")  # the latter: pytest.importorskip's reason


class TestsLog:
    """tests.log as it stands now: `<kind>\\t<seconds>\\t<node id>\\t<note>` lines."""

    def __init__(self, path: Path, dry_run: bool):
        self.collected: List[str] = []
        self.started = set()
        self.done: Dict[str, Tuple[str, str]] = {}  # node id -> (result, note)
        for line in (path.read_text(errors="replace").splitlines() if path.exists() else []):
            kind, _secs, nodeid, note = (line.split("\t", 3) + ["", "", ""])[:4]
            if kind == "collected":
                self.collected.append(nodeid)
            elif kind == "started":
                self.started.add(nodeid)
            elif kind in RESULTS:
                self.done[nodeid] = (kind, note)
        self.unfinished = [n for n in self.collected if n not in self.done]
        self.failed = [(n, kind, note) for n, (kind, note) in self.done.items() if kind in BAD]
        skipped = [(n, note) for n, (kind, note) in self.done.items() if kind == "skipped"]
        # a GPU test may skip on a GPU machine only for a missing optional package; on a CPU dry run
        # every GPU test skips, as expected
        self.allowed_skips = [s for s in skipped if dry_run or any(a in s[1] for a in ALLOWED_SKIPS)]
        self.bad_skips = [s for s in skipped if s not in self.allowed_skips]
        self.dry_run = dry_run

    def counts(self) -> str:
        n = Counter(kind for kind, _ in self.done.values())
        return (f"{len(self.done)} of {len(self.collected)} finished ("
                + (", ".join(f"{n[k]} {k}" for k in RESULTS if n[k]) or "none") + ")")

    def section(self) -> List[str]:
        running = [n for n in self.unfinished if n in self.started]
        lines = ["## tests", "", f"{self.counts()}; {len(self.unfinished)} unfinished ({len(running)} running "
                 f"when stopped, {len(self.unfinished) - len(running)} never started). One line per test in "
                 "tests.log, tracebacks in failures.txt.", ""]

        def block(title: str, items: List[str]) -> None:
            if items:
                lines.extend([f"{title} ({len(items)}):", *[f"- {i}" for i in items], ""])

        block("failed", [f"`{n}` {kind}: {note}" for n, kind, note in self.failed])
        block("running when stopped", [f"`{n}`" for n in running])
        block("never started", [f"`{n}`" for n in self.unfinished if n not in self.started])
        block("skips not allowed on a GPU machine", [f"`{n}`: {why}" for n, why in self.bad_skips])
        expected = "expected on a --dry-run-on-cpu run (no GPU)" if self.dry_run else "allowed"
        reasons = Counter(why for _, why in self.allowed_skips).most_common()
        block(f"skips {expected}, by reason", [f"{c} x {why}" for why, c in reasons])
        return lines


def write(out: Path, title: str, status: str, notes: List[str], rows: Dict[str, dict], tests) -> None:
    """Replace OUT/summary.md in one step (never half-written, whenever the run is stopped)."""
    lines = [title, "", f"status: {status}", "", *[f"- {n}" for n in notes], "",
             "| step | verdict | seconds | limit | notes |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        secs = "" if r["secs"] is None else f"{r['secs']:.0f}"
        lines.append(f"| {name} | {r['verdict']} | {secs} | {r['limit']:.0f} | {r['what'].replace('|', '/')} |")
    if tests is not None:
        lines += ["", *tests.section()]
    tmp = out / "summary.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "summary.md")
