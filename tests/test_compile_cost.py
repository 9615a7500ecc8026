"""torch.compile's cost stated per run, and reused across processes: the summary's ``compile`` line
says the seconds in compile_model and on first use and whether Inductor's cache was cold or warm;
a second process with the same cache directory loads compiled code instead of building it."""

import os
import re
import subprocess
import sys
from pathlib import Path

from workbench.runtime.compile_cost import InductorState, compile_line

REPO = Path(__file__).resolve().parents[1]


def test_the_line_names_the_seconds_and_the_cache_state():
    start = InductorState(dynamo_s=0.0, hits=0, misses=0)
    before = InductorState(dynamo_s=10.0, hits=0, misses=2)
    cold = compile_line(148.7, start, before, InductorState(dynamo_s=57.1, hits=0, misses=9))
    assert cold is not None and cold.startswith("148.7 s in compile_model, 47.1 s on first use (new shapes)")
    assert "0 hits, 9 misses (cold: the next run of this model and config reuses" in cold
    warm = compile_line(7.7, None, None, InductorState(dynamo_s=2.4, hits=9, misses=0))
    assert warm == (
        "7.7 s in compile_model, 2.4 s on first use (new shapes); "
        "Inductor cache 9 hits, 0 misses (warm: compiled code loaded, not built)"
    )
    assert "partly warm" in compile_line(None, None, None, InductorState(1.0, hits=3, misses=1))
    # nothing compiled (torch-simple, or torch's compiler never imported): no line
    assert compile_line(0.001, None, None, None) is None
    assert compile_line(0.001, None, None, InductorState(0.0, 0, 0)) is None
    # the counters are per process: an earlier compile in the same process (a notebook, a test
    # worker) is not this run's, and only this run's hits and misses are counted
    earlier = InductorState(dynamo_s=30.0, hits=4, misses=6)
    assert compile_line(0.001, earlier, earlier, earlier) is None
    partly = compile_line(2.0, earlier, earlier, InductorState(dynamo_s=31.5, hits=7, misses=6))
    assert partly is not None and "1.5 s on first use" in partly and "3 hits, 0 misses (warm" in partly


def _run(cache_dir: Path) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "workbench.cli", "run", "--model", "tiny:llama", "--no-numerics",
           "--set", "compile_model.backend=torch-compile", "--max-new-tokens", "4"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_a_second_process_reuses_the_compiled_code(tmp_path):
    first, second = _run(tmp_path / "inductor"), _run(tmp_path / "inductor")
    line = re.compile(r"compile   ([\d.]+) s in compile_model, ([\d.]+) s on first use .*; "
                      r"Inductor cache (\d+) hits, (\d+) misses \((\w+)")
    cold, warm = line.search(first), line.search(second)
    assert cold and warm, (first[-1500:], second[-1500:])
    assert int(cold.group(4)) > 0 and cold.group(5) == "cold"
    assert int(warm.group(3)) == int(cold.group(4)) and int(warm.group(4)) == 0 and warm.group(5) == "warm"
    # loading compiled code is faster than building it (the margins measured: 16.8 -> 3.1 s)
    assert float(warm.group(1)) < float(cold.group(1))
    tokens = [re.search(r"tokens: (\[.*\])", out).group(1) for out in (first, second)]
    assert tokens[0] == tokens[1]  # the same answer either way
