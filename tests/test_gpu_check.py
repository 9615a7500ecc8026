"""``tools/gpu_check.py``'s tests step, on CPU, against a generated test folder: one test passes, one
fails, one sleeps far past the step's limit. Whether the step hits its limit or gpu_check itself is
SIGKILLed mid-run, the results on disk must already name every test that finished, and nothing may
be left running. pytest-xdist is used when the venv running this has it (the GPU machine's does);
otherwise gpu_check falls back to a serial run and says so."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
XDIST = importlib.util.find_spec("xdist") is not None

DEMO = '''
import os, time
import pytest

@pytest.mark.gpu
def test_a_pass():
    pass

@pytest.mark.gpu
def test_b_fail():
    assert 1 + 1 == 3, "deliberate failure"

@pytest.mark.gpu
def test_c_sleep():
    with open(os.environ["GPU_CHECK_SLEEPER_PID"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
'''


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its reaper has not looked yet


def gpu_check(tmp_path: Path, limit: int, *extra: str, **popen):
    """Start gpu_check's tests step on the demo folder, in a process group of its own."""
    tests = tmp_path / "demo"
    tests.mkdir()
    (tests / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")  # rootdir: node ids are short
    (tests / "test_demo.py").write_text(DEMO)
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_SLEEPER_PID": str(tmp_path / "sleeper.pid")}
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out), "--steps", "tests",
           "--dry-run-on-cpu", "--wheelhouse", str(tmp_path / "no-wheels"), "--site", str(tmp_path / "site"),
           "--workers", "2", "--limit", f"tests={limit}", "--pytest-args", f"-m gpu {tests}", *extra]
    return out, subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **popen)


def results(out: Path) -> dict:
    rows = [line.split("\t") for line in (out / "tests.log").read_text().splitlines()]
    return {r[2]: r[0] for r in rows if r[0] not in ("collected", "started")}


def wait_gone(pid_file: Path, seconds: float = 15) -> None:
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the sleeping test (pid {pid}) outlived gpu_check")


def test_tests_step_limit_kills_the_run_and_names_every_test(tmp_path):
    limit = 30  # pytest and its 2 xdist workers start in ~5 s here, in >12 s on a loaded 2-core machine
    t0 = time.monotonic()
    out, proc = gpu_check(tmp_path, limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=limit + 45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - t0 < limit + 45
    assert proc.returncode == 1, stdout

    assert results(out) == {"test_demo.py::test_a_pass": "passed", "test_demo.py::test_b_fail": "failed"}, stdout
    failures = (out / "failures.txt").read_text()
    assert "test_demo.py::test_b_fail" in failures and "deliberate failure" in failures
    assert "assert (1 + 1) == 3" in failures  # the traceback itself, not only the message
    summary = (out / "summary.md").read_text()
    assert f"| tests | TIMED OUT |" in summary and f"timed out after {limit} s" in summary, summary
    assert "2 of 3 finished (1 passed, 1 failed); 1 unfinished" in summary, summary
    running = summary.split("running when stopped (1):\n", 1)[1]
    assert running.startswith("- `test_demo.py::test_c_sleep`"), summary
    assert "`test_demo.py::test_b_fail` failed: AssertionError: deliberate failure" in summary
    assert ("xdist workers" if XDIST else "serially (pytest-xdist missing)") in summary

    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files
    wait_gone(tmp_path / "sleeper.pid")  # the step's process group was killed, xdist workers included


def test_sigkilled_gpu_check_leaves_finished_tests_on_disk(tmp_path):
    out, proc = gpu_check(tmp_path, 120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "sleeper.pid"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # midway through the sleeping test
            if pid_file.exists() and len(results(out)) == 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the demo tests did not get going: {(out / 'tests.log').read_text()}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # gpu_check itself: no handler, no last summary
        proc.wait()
    assert results(out) == {"test_demo.py::test_a_pass": "passed", "test_demo.py::test_b_fail": "failed"}
    assert "test_b_fail" in (out / "failures.txt").read_text()
    summary = (out / "summary.md").read_text()
    assert "status: **running**" in summary and "| tests | running |" in summary, summary
    # its children get a parent-death signal: the pytest run (and xdist workers) end with it
    wait_gone(pid_file)


@pytest.mark.skipif(importlib.util.find_spec("pytest_timeout") is None, reason="pytest-timeout is not installed")
def test_per_test_timeout_ends_the_hung_test_not_the_step(tmp_path):
    out, proc = gpu_check(tmp_path, 120, "--test-timeout", "3", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        stdout, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # serially pytest-timeout's signal method fails the test; with xdist its thread method ends the
    # worker, which xdist reports as a crash (and replaces)
    assert results(out) == {"test_demo.py::test_a_pass": "passed", "test_demo.py::test_b_fail": "failed",
                            "test_demo.py::test_c_sleep": "crashed" if XDIST else "failed"}, stdout
    summary = (out / "summary.md").read_text()
    assert "| tests | FAILED |" in summary and "3 of 3 finished" in summary, summary
    assert "per-test timeout 3 s" in summary and "`test_demo.py::test_c_sleep`" in summary
    wait_gone(tmp_path / "sleeper.pid")
