"""``bench/decode.py`` end to end on CPU, on random weights of SmolLM2-135M's config (``shape:smollm2``):
the GPU benchmarks run the same script on ``shape:`` models, where a crash or a table printed only at
the end costs a whole device slot. So this runs it as a subprocess, the way a device check does, and
reads its stdout: every row must be streamed as its own line before the final table, peers switched
off must measure nothing, and a ratio whose peer is off prints "-". About 25 s per run on the
project's 2-core machine (export + the pipeline's transforms dominate; numerics is off in the bench).
"""

import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode.py"
# a 4-token prompt and 3 new tokens at batch 1: the smallest run that still times decode steps
SMALL = ["--model", "shape:smollm2", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1",
         "--prompt-len", "4", "--new-tokens", "3", "--no-hf-compile", "--no-hf-graph-loop", "--no-llama-cpp",
         "--paired-rounds", "0"]
STREAMED = re.compile(r"^row (?P<name>.+?) +bs +(?P<batch>\S+) +(?P<tok_s>\S+) tok/s  (?P<note>.*)$")


def run_bench(*flags: str) -> Tuple[Dict[str, Tuple[int, str, str]], List[str], int]:
    """(streamed rows by name: (line index, tok/s, note), stdout lines, index of the table's header)."""
    proc = subprocess.run([sys.executable, str(BENCH), *SMALL, *flags], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    streamed = {m["name"].strip(): (i, m["tok_s"], m["note"])
                for i, line in enumerate(lines) if (m := STREAMED.match(line))}
    table = next(i for i, line in enumerate(lines) if "x HF eager" in line)
    return streamed, lines, table


def table_columns(lines: List[str], table: int, name: str) -> List[str]:
    """batch, tok/s, x HF eager, x best peer, ... of the table's row ``name``."""
    line = next(line for line in lines[table + 1:] if line.startswith(name + " "))
    return line[len(name):].split()


def test_every_peer_off_streams_the_workbench_row_before_the_table():
    """One run (each costs ~25 s of the suite): every peer off, the compile backend left to auto."""
    streamed, lines, table = run_bench("--backends", "auto", "--no-hf-eager")
    index, tok_s, note = streamed["workbench auto"]
    assert float(tok_s) > 0 and index < table, "\n".join(lines)
    # the attention and compile backends auto chose on CPU, and why
    # (on CPU attention auto follows this CPU's calibration: the kernel, with the times behind it)
    assert "attention cpu [auto on cpu: cpu, calibrat" in note and "compile torch-simple [auto on cpu" in note, note
    peers = {name: row for name, row in streamed.items() if not name.startswith("workbench")}
    assert {"HF generate eager", "HF static cache + HF compile", "llama.cpp (llama-cpp-python)"} <= set(peers)
    for name, (_, tok_s, note) in peers.items():
        assert tok_s == "-" and note.startswith("skipped (--no-"), (name, tok_s, note)
    assert table_columns(lines, table, "workbench auto")[2:4] == ["-", "-"]  # no peer to compare with
