"""Time to first token of ``workbench run --model smollm2``: where the seconds go, and peak memory.

    .venv/bin/python bench/startup.py                  # the default: Q4_1 weights kept, defaults
    .venv/bin/python bench/startup.py --repeats 3 -- --gguf-weights dequantize

Runs the CLI as a child process (a fresh interpreter each time, as a user would) and timestamps
every line it prints from the moment of the spawn: the load line, the pipeline total, the prompt
line (generation starts there) and the generate stats (their TTFT). First token = time of the
prompt line + TTFT. The split: imports (spawn to the load line, less the load), load, the
transforms and the numerics probes with the snapshots (the pipeline line's two parts), and how
many probes came from the probe cache. Peak RSS is the child's own ``ru_maxrss`` (``os.wait4``). The numerics probes
are on, as by default. Run it twice: the first run after an install pays the one-off builds (the
C++ kernels, the pattern-ops and probe caches); ``WORKBENCH_CACHE_DIR=off`` measures a run with
no cache at all.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent


def one_run(extra) -> dict:
    cmd = [sys.executable, "-m", "workbench.cli", "run", "--model", "smollm2", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: dict = {}
    lines = []
    for line in proc.stdout:
        t = time.perf_counter() - t0
        lines.append(line.rstrip())
        if line.startswith("model:") and (m := re.search(r"loaded in ([\d.]+)s", line)):
            out["load_s"], out["loaded_at_s"] = float(m.group(1)), t
        elif line.startswith("pipeline:") and (m := re.search(r"in ([\d.]+)s", line)):
            out["pipeline_s"], out["pipeline_done_at_s"] = float(m.group(1)), t
            if m := re.search(r"the transforms ([\d.]+)s", line):
                out["transforms_s"] = float(m.group(1))
            if m := re.search(r"and the snapshots ([\d.]+)s", line):
                out["probes_s"] = float(m.group(1))
            out["probes_cached"] = int(m.group(1)) if (m := re.search(r"(\d+) read from the probe cache", line)) else 0
        elif line.startswith("prompt:"):
            out["prompt_at_s"] = t
        elif line.startswith("generate:"):
            if m := re.search(r"ttft (\d+) ms", line):
                out["first_token_s"] = out["prompt_at_s"] + int(m.group(1)) / 1000
            if m := re.search(r"([\d.]+) tok/s decode", line):
                out["decode_tok_s"] = float(m.group(1))
        elif line.startswith("output:"):
            out["output"] = line[len("output:"):].strip()
    # this child's own rusage (RUSAGE_CHILDREN's ru_maxrss is the largest of all children so far)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out["wall_s"] = time.perf_counter() - t0
    if "loaded_at_s" in out:  # spawn to the load line, less the load itself: interpreter and imports
        out["imports_s"] = out["loaded_at_s"] - out["load_s"]
    out["returncode"] = proc.returncode
    out["peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    if proc.returncode != 0:
        print("\n".join(lines[-20:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="arguments after -- go to `workbench run`")
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        r = one_run(args.extra)
        runs.append(r)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v!r}"
                                          for k, v in r.items()), flush=True)
    keys = ("imports_s", "load_s", "transforms_s", "probes_s", "pipeline_s", "first_token_s", "decode_tok_s",
            "wall_s", "peak_rss_mb")
    print("median over runs: " + ", ".join(f"{k} {median(r[k] for r in runs if k in r):.2f}" for k in keys
                                           if any(k in r for r in runs)))


if __name__ == "__main__":
    main()
