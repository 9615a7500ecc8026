"""The rows of ``bench/decode.py`` and how they print: one line per row the moment it is measured,
then the summary table once every row is in.

A run under a time limit can be killed at any moment: on an H100 a run whose only output was the
final table printed nothing in 125 s. So every row is printed and flushed as soon as it exists, in a
fixed-width line that already carries the tok/s and the note, and a killed run still shows every
row it measured. The table's ratios ("x HF eager", "x best peer") need all rows, so the table comes
last; a ratio whose peer did not run (switched off, skipped, failed) prints "-".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

from workbench.runtime.generate import format_step_profile

NAME_WIDTH = 51  # the longest row name: "HF model, own decode loop, compile(reduce-overhead)"


@dataclass
class Row:
    name: str
    batch: int  # 0: a row that measured nothing (skipped, failed)
    tok_s: Optional[float]
    note: str = ""
    step_bytes: Optional[int] = None  # weight bytes a decode step reads, when not the model's
    peer_dtype: bool = True  # runs the benchmark's dtype: counts as a peer for "x best peer"
    step_ms: Optional[Dict[str, float]] = None  # workbench rows: median decode-step split (profiled run)
    kernels: Optional[float] = None  # CUDA kernels one decode step launches (profiler), where measured

    def detail(self) -> str:
        """The decode-step split and kernel count, printed with the row as soon as it is measured."""
        parts = [f"step ms: {format_step_profile(self.step_ms)}"] if self.step_ms else []
        if self.kernels is not None:
            parts.append(f"{self.kernels:.0f} kernels/step")
        return " | " + "; ".join(parts) if parts else ""


def stream_line(r: Row) -> str:
    """``row <name> bs <B> <tok/s> tok/s  <note>``: fixed columns, "-" where nothing was measured."""
    tok = f"{r.tok_s:9.1f}" if r.tok_s is not None else f"{'-':>9s}"
    return f"row {r.name:{NAME_WIDTH}s} bs {r.batch or '-':>4} {tok} tok/s  {r.note}{r.detail()}"


class RowLog:
    """The rows measured so far; each is printed (flushed) when it is added, not when the table is."""

    def __init__(self) -> None:
        self.rows: List[Row] = []

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(stream_line(row), flush=True)

    def add_all(self, rows: Iterable[Row]) -> None:
        """``rows`` may be a generator: each row is printed as the generator measures it."""
        for row in rows:
            self.add(row)


def _ratio(value: float, ref: Optional[float], width: int) -> str:
    return f"{value / ref:{width}.2f}" if ref else f"{'-':>{width}s}"


def print_table(rows: List[Row], step_bytes: int, copy_bw: float, gemv_bw: float) -> None:
    eager = {r.batch: r.tok_s for r in rows if r.name == "HF generate eager" and r.tok_s}
    peers: Dict[int, float] = {}
    for r in rows:
        if r.tok_s and r.peer_dtype and not r.name.startswith("workbench"):
            peers[r.batch] = max(peers.get(r.batch, 0.0), r.tok_s)
    print(f"\n{'':{NAME_WIDTH}s} {'batch':>5s} {'tok/s':>9s} {'x HF eager':>10s} {'x best peer':>11s} "
          f"{'copy BW':>8s} {'GEMV BW':>8s}  note")
    for r in rows:
        if r.tok_s is None:
            print(f"{r.name:{NAME_WIDTH}s} {r.batch or '':>5} {'-':>9s} {'':10s} {'':11s} {'':8s} {'':8s}  {r.note}")
            continue
        achieved = (r.step_bytes or step_bytes) * r.tok_s / r.batch
        print(f"{r.name:{NAME_WIDTH}s} {r.batch:5d} {r.tok_s:9.1f} {_ratio(r.tok_s, eager.get(r.batch), 10)} "
              f"{_ratio(r.tok_s, peers.get(r.batch), 11)} {achieved / copy_bw:8.0%} {achieved / gemv_bw:8.0%}  {r.note}")
    profiled = [r for r in rows if r.step_ms]
    if profiled:
        print("\nper decode step, median ms (a separate profiled run; 'gpu' = CUDA-event time of the runner call,"
              " the graph replay with CUDA graphs; the rest is host time):")
        for r in profiled:
            kernels = f"; {r.kernels:.0f} kernels/step" if r.kernels is not None else ""
            print(f"  {r.name:36s} bs {r.batch:3d}: {format_step_profile(r.step_ms)}{kernels}")


def print_q4_ratios(rows: List[Row]) -> None:
    """The 4-bit comparison: workbench on the file's own Q4_1 weights vs llama.cpp on the same file."""
    ref = {r.batch: r.tok_s for r in rows if r.name.endswith(" packaged") and r.tok_s}
    q4 = [r for r in rows if r.name.startswith("workbench int4") and r.tok_s]
    for r in q4:
        if r.batch in ref:
            print(f"{r.name} bs {r.batch}: {r.tok_s:.1f} tok/s = {r.tok_s / ref[r.batch]:.2f}x llama.cpp Q4_1 "
                  f"({ref[r.batch]:.1f} tok/s)")
