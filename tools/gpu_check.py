"""``make gpu-check``: the GPU tests and the GPU decode benchmark on a lent machine (CUDA torch
preinstalled, no network) inside one time budget, every result on disk as soon as it exists.

    make wheelhouse                     # where pip works: the missing deps + FlashInfer, as wheels
    make gpu-check OUT=/tmp/gpu-out     # on the GPU machine: the default steps in 500 s
    make gpu-check OUT=... GPU_CHECK_STEPS=tests GPU_CHECK_ARGS='--limit tests=400 --budget 420'

The wheels are installed with ``--target`` into ``--site`` (torch/triton untouched), which goes on
the steps' PYTHONPATH. Steps, in this order, with their limits in seconds (``--limit STEP=S``):

  env             30  versions and device -> env.json; no CUDA device fails it and ends the run
  flashinfer-jit  75  tools/flashinfer_warmup.py JIT-builds the FlashInfer kernels the tests use
                      (one JSON line of timings); skipped if ``import flashinfer`` fails or the script
                      is absent. Killed mid-build, ninja keeps the finished objects for the tests.
  tests          200  ``pytest -m gpu tests`` (``--pytest-args``) on min(16, CPUs) pytest-xdist
                      workers (``--dist worksteal``: why in step_tests; serial without xdist), each
                      test under ``--test-timeout`` 120 s (pytest-timeout); tools/pytest_stream.py
                      logs each test as it ends. A skip fails it unless its reason names a missing
                      optional package (on --dry-run-on-cpu every GPU skip is expected).
  bench-smollm2  130  bench/decode.py on shape:smollm2 (random bf16 weights), batch 1, 8 and 32: HF
                      eager and the workbench's auto (CUDA graphs) and torch-simple rows
  bench-llama3    65  the same on shape:llama3-8b, batch 1
  opt-in:
  bench-peers    300  what compiles for minutes: HF static cache + compile, HF graph loop, and the
                      workbench's torch-compile / torch-opt rows
  export         240  tools/export_report.py on the tiny archs with this torch

The defaults add up to ``--budget`` (500 s, counted from the start, wheel install included): a
step gets min(its limit, what is left) and is skipped, and said so, when less than its minimum is
left. At its limit a step's process group (xdist workers and compilers included) gets SIGTERM,
SIGKILL 3 s later, and the summary says "timed out after N s", for tests with the finished, failed
and unfinished tests by name. The steps' processes also die with this script (parent-death signal).

Files in ``--out`` (flat, 6): summary.md (tools/gpu_check_summary.py; written first, rewritten
every 10 s and after each step), env.json, tests.log (collected / started / one line per finished
test), failures.txt (tracebacks as they happen), steps.log (output of the wheel install, env,
flashinfer-jit, tests, export) and bench.log (bench output, streamed). Exit status 1 if a step
failed, timed out or was not run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import gpu_check_summary as summary  # tools/, this script's folder

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
KILL_GRACE = 3  # seconds between SIGTERM and SIGKILL of a step's process group
FILES = ("summary.md", "env.json", "tests.log", "failures.txt", "steps.log", "bench.log", "summary.md.tmp",
         # what the first version of this script wrote: removed too, or OUT would hold two runs' files
         "env.log", "export.log", "flashinfer-jit.log", "tests-skips.txt", "gpu-tests.xml",
         "bench-smollm2.log", "bench-llama3.log")


class Stopped(Exception):  # SIGTERM/SIGINT to this script: the step is killed, the summary says so
    pass


@dataclass
class Step:
    limit: int  # seconds, at most
    minimum: int  # skipped when less than this is left of the budget
    fn: Callable


Ran = namedtuple("Ran", "rc secs timed_out output")  # output: the tail of what the command printed


def _die_with_parent() -> None:  # preexec_fn: SIGKILL the step when this script dies (Linux)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Check:
    def __init__(self, args, steps: List[str]):
        self.args, self.out, self.t0 = args, args.out, time.monotonic()
        self.title = f"# gpu-check {time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node()}"
        self.rows = {s: {"verdict": "pending", "secs": None, "limit": STEPS[s].limit, "what": ""} for s in steps}
        self.notes: List[str] = []
        self.env = dict(os.environ)
        self.last_write = 0.0
        self.tests_ran = False
        self.current: Optional[str] = None  # the step running now, and since when
        self.step_t0 = 0.0

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def sh(self, title: str, cmd: List[str], log: str, limit: float, env=None, tick=None) -> Ran:
        """Run cmd in a process group of its own, output appended to OUT/log; at `limit` s kill the group."""
        path = self.out / log
        with path.open("a") as f:
            start = f.tell()
            f.write(f"\n===== {title} (limit {limit:.0f} s): $ {shlex.join(cmd)}\n")
            f.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env=env or self.env, start_new_session=True, preexec_fn=_die_with_parent)
            timed_out = False
            try:
                while proc.poll() is None:
                    if time.monotonic() - t0 >= limit:
                        timed_out = True
                        break
                    time.sleep(0.5)
                    if time.monotonic() - self.last_write >= 10:  # summary.md current within 10 s
                        if self.current:
                            self.rows[self.current]["secs"] = time.monotonic() - self.step_t0
                        if tick:
                            tick()
                        self.write_summary()
            finally:  # also on success: stray grandchildren must not outlive their step
                self._kill_group(proc, gently=proc.poll() is None)
            secs = time.monotonic() - t0
            if timed_out:
                f.write(f"\n[gpu-check] {title}: timed out after {limit:.0f} s: process group killed\n")
        with path.open("rb") as f:
            f.seek(max(start, path.stat().st_size - 20000))
            output = f.read().decode(errors="replace")
        rc = proc.returncode if proc.returncode is not None else -9
        return Ran(124 if timed_out else rc, secs, timed_out, output)

    @staticmethod
    def _kill_group(proc: subprocess.Popen, gently: bool) -> None:
        for sig in ((signal.SIGTERM, signal.SIGKILL) if gently else (signal.SIGKILL,)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a wedged driver call): leave it
            pass

    def tests(self) -> summary.TestsLog:
        return summary.TestsLog(self.out / "tests.log", self.args.dry_run_on_cpu)

    def write_summary(self, status: str = "running") -> None:
        self.last_write = time.monotonic()
        status = f"**{status}** after {time.monotonic() - self.t0:.0f} s of a {self.args.budget} s budget"
        status += " (--dry-run-on-cpu)" if self.args.dry_run_on_cpu else ""
        summary.write(self.out, self.title, status, self.notes, self.rows, self.tests() if self.tests_ran else None)


# -------------------------------------------------------------------------------------- steps
def py(*argv: str) -> List[str]:
    return [sys.executable, *argv]


ENV_CODE = """
import json, os, platform, sys, torch, transformers
from importlib import metadata
info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
        'transformers': transformers.__version__, 'cpus': os.cpu_count(),
        'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None}
for name in ('triton', 'flashinfer-python', 'pydantic', 'gguf', 'graphviz', 'pytest', 'pytest-xdist', 'pytest-timeout'):
    try:
        info[name] = metadata.version(name)
    except Exception as e:
        info[name] = f'missing ({type(e).__name__})'
open(sys.argv[1], 'w').write(json.dumps(info, indent=1))
print(json.dumps(info))
"""


def step_env(c: Check, limit: float) -> Tuple[str, str]:
    ran = c.sh("env", py("-c", ENV_CODE, str(c.out / "env.json")), "steps.log", limit)
    if ran.rc or not (c.out / "env.json").exists():
        return "FAILED", f"rc {ran.rc}: {(ran.output.strip().splitlines() or ['?'])[-1][:200]}"
    info = json.loads((c.out / "env.json").read_text())
    if info["gpu"] is None and not c.args.dry_run_on_cpu:
        return "FAILED", f"no CUDA device visible to torch {info['torch']}: make gpu-check needs a GPU machine"
    return "ok", ", ".join(f"{k} {v}" for k, v in info.items())


def step_flashinfer_jit(c: Check, limit: float) -> Tuple[str, str]:
    probe = c.sh("flashinfer-jit: import flashinfer", py("-c", "import flashinfer"), "steps.log", min(limit, 60))
    if probe.rc:
        why = (probe.output.strip().splitlines() or ["?"])[-1][:160]
        return "skipped", f"optional package missing: flashinfer-python (import flashinfer: {why})"
    script = TOOLS / "flashinfer_warmup.py"
    if not script.exists():
        return "skipped", "tools/flashinfer_warmup.py does not exist yet: the tests JIT-build FlashInfer themselves"
    if c.args.dry_run_on_cpu:
        return "skipped", "--dry-run-on-cpu: FlashInfer's JIT builds need CUDA"
    ran = c.sh("flashinfer-jit", py(str(script)), "steps.log", limit - probe.secs)
    timings = [ln for ln in ran.output.splitlines() if ln.startswith("{")]
    what = timings[-1][:400] if timings else "no JSON line (see steps.log)"
    if ran.timed_out:
        return "TIMED OUT", f"timed out after {limit:.0f} s (finished objects stay in $FLASHINFER_WORKSPACE_BASE)"
    return ("ok" if ran.rc == 0 else "FAILED"), f"rc {ran.rc}: {what}"


def step_tests(c: Check, limit: float) -> Tuple[str, str]:
    a = c.args
    env = dict(c.env)
    cmd = py("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_stream",
             "--stream-log", str(c.out / "tests.log"), "--stream-failures", str(c.out / "failures.txt"))
    have = lambda mod: importlib.util.find_spec(mod) is not None  # noqa: E731 - sys.path holds --site
    workers = a.workers if have("xdist") else 0
    if workers > 1:
        # worksteal, not loadfile/loadgroup: test_generate.py alone is 76 of the 144 GPU tests (one tiny
        # arch each), which loadfile puts on one worker; and under pytest-xdist 3.8 a crashed worker
        # (pytest-timeout's thread method) makes loadgroup/loadscope hang and loadfile re-run the test
        # until the restart limit (xdist issues #1323, #1378, PR #1371). worksteal hands each worker a
        # contiguous run of tests (one file's tests together: in-process JIT and module fixtures
        # shared) and lets idle workers take from busy ones; Triton's and Inductor's on-disk caches
        # are shared across workers anyway.
        cmd += ["-n", str(workers), "--dist", a.dist]
        per_worker = str(max(1, (os.cpu_count() or 1) // workers))
        env.setdefault("OMP_NUM_THREADS", per_worker)  # not 16 OpenMP threads in each of 16 workers
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", per_worker)  # nor 16 compile subprocesses each
        how = f"{workers} xdist workers, --dist {a.dist}"
    else:
        how = "serially (" + ("pytest-xdist missing" if a.workers > 1 else f"--workers {a.workers}") + ")"
        # (a serial run of the 144 GPU tests took 180 s for 38 of them: it will not fit the budget)
    if a.test_timeout and have("pytest_timeout"):
        # thread: also ends a test hung inside C/CUDA code, where a signal is never handled; it
        # exits the process, so only with xdist (which reports the test as crashed and starts a
        # new worker); serially signal, or the first timeout would end the whole run
        method = "thread" if workers > 1 else "signal"
        cmd += ["--timeout", str(a.test_timeout), "--timeout-method", method]
        if method == "thread":  # its own stack dump dies with the worker: faulthandler's reaches steps.log
            cmd += ["-o", f"faulthandler_timeout={max(1, int(a.test_timeout * 0.95))}"]
        how += f", per-test timeout {a.test_timeout} s ({method})"
    else:
        how += ", no per-test timeout" + ("" if not a.test_timeout else " (pytest-timeout missing)")
    c.notes.append(f"tests: {how}")
    c.tests_ran = True
    cmd += shlex.split(a.pytest_args)

    def tick() -> None:
        c.rows["tests"]["what"] = c.tests().counts()

    ran = c.sh("tests", cmd, "steps.log", limit, env=env, tick=tick)
    t = c.tests()
    if ran.timed_out:
        return "TIMED OUT", f"timed out after {limit:.0f} s: {t.counts()}; {len(t.unfinished)} unfinished"
    if ran.rc == 5 or not t.collected:
        return "FAILED", f"rc {ran.rc}: pytest collected no tests (see steps.log)"
    what = f"{t.counts()} in {ran.secs:.0f} s"
    if t.bad_skips:
        what += f"; {len(t.bad_skips)} skip(s) not allowed on a GPU machine"
    if ran.rc and not t.failed:
        what += f"; pytest rc {ran.rc} (see steps.log)"
    return ("ok" if ran.rc == 0 and not t.bad_skips else "FAILED"), what


def _bench(model: str, batches: List[str], extra: List[str]) -> Callable:
    def step(c: Check, limit: float) -> Tuple[str, str]:
        flags = list(extra)
        if c.args.dry_run_on_cpu:  # the same script on a tiny model, a few tokens, the cheapest backend
            where = ["--device", "cpu", "--dtype", "float32", "--model", "tiny:llama", "--new-tokens", "8",
                     "--prompt-len", "16", "--backends", "torch-simple"]
        else:
            where = ["--device", "cuda", "--dtype", "bfloat16", "--model", model]
        ran = c.sh(f"bench {model}", py("bench/decode.py", *where, "--batch-sizes", *batches, *flags),
                   "bench.log", limit)
        rows = [ln for ln in ran.output.splitlines() if ln.startswith("row ")]  # printed as measured
        what = f"{len(rows)} rows ({sum(' failed' in r for r in rows)} failed) in bench.log"
        if ran.timed_out:
            return "TIMED OUT", f"timed out after {limit:.0f} s; {what} (rows printed so far)"
        return ("ok" if ran.rc == 0 else "FAILED"), f"rc {ran.rc} in {ran.secs:.0f} s; {what}"
    return step


def step_export(c: Check, limit: float) -> Tuple[str, str]:
    archs = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
    ran = c.sh("export", py("tools/export_report.py", "--new-tokens", "8", *[f"tiny:{a}" for a in archs]),
               "steps.log", limit)
    if ran.timed_out:
        return "TIMED OUT", f"timed out after {limit:.0f} s"
    return ("ok" if ran.rc == 0 else "FAILED"), f"rc {ran.rc} in {ran.secs:.0f} s (JSON report in steps.log)"


# the default bench steps: HF eager as the peer, and the workbench's default (auto: CUDA graphs where the
# graph captures) beside the plain graph; torch-compile / torch-opt compile for minutes (bench-peers)
NO_PEERS = ["--no-hf-compile", "--no-hf-graph-loop", "--backends", "auto", "torch-simple"]
STEPS: Dict[str, Step] = {
    "env": Step(30, 10, step_env),
    "flashinfer-jit": Step(75, 20, step_flashinfer_jit),
    "tests": Step(200, 60, step_tests),
    "bench-smollm2": Step(130, 30, _bench("shape:smollm2", ["1", "8", "32"], NO_PEERS)),
    "bench-llama3": Step(65, 30, _bench("shape:llama3-8b", ["1"], NO_PEERS)),
    # opt-in: HF static cache + HF compile and the HF graph loop compile for minutes
    "bench-peers": Step(300, 60, _bench("shape:smollm2", ["1", "8"], ["--hf-graph-loop", "--no-hf-eager",
                                                                      "--no-llama-cpp"])),
    "export": Step(240, 60, step_export),
}
DEFAULT_STEPS = ("env", "flashinfer-jit", "tests", "bench-smollm2", "bench-llama3")


def install_wheels(c: Check) -> str:
    wheels = sorted(c.args.wheelhouse.glob("*.whl"))
    if not wheels:
        return f"no wheels in {c.args.wheelhouse} (run `make wheelhouse` where pip works)"
    stamp = c.args.site / ".gpu-check-wheels"  # same wheels already there (a rerun in one lease): skip
    names = "\n".join(w.name for w in wheels)
    if stamp.exists() and stamp.read_text() == names:
        return f"{len(wheels)} wheels already installed in {c.args.site}"
    c.args.site.mkdir(parents=True, exist_ok=True)
    ran = c.sh("wheels", py("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                            "--target", str(c.args.site), *map(str, wheels)), "steps.log", min(120, c.left()))
    if ran.rc:
        return f"FAILED to install the wheels (rc {ran.rc}, see steps.log)"
    stamp.write_text(names)
    return f"installed {len(wheels)} wheels into {c.args.site} in {ran.secs:.0f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / ".whl")
    ap.add_argument("--site", type=Path, default=Path("/tmp/workbench-gpu-site"))
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS), help=f"comma-separated, of: {', '.join(STEPS)}")
    ap.add_argument("--budget", type=int, default=500, help="seconds for the whole run (default 500)")
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=S", help="a step's own limit")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="pytest-xdist workers")
    ap.add_argument("--dist", default="worksteal", help="pytest-xdist --dist mode (default worksteal)")
    ap.add_argument("--test-timeout", type=int, default=120, help="seconds per test (pytest-timeout; 0: none)")
    ap.add_argument("--pytest-args", default="-m gpu tests", help="what the tests step runs (default '-m gpu tests')")
    ap.add_argument("--dry-run-on-cpu", action="store_true",
                    help="exercise this script on a CPU machine (GPU tests skip, benchmarks on tiny:llama)")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}")
    for item in args.limit:
        name, _, secs = item.partition("=")
        if name not in STEPS or not secs.isdigit():
            ap.error(f"--limit {item!r}: want STEP=SECONDS with a step of {', '.join(STEPS)}")
        STEPS[name].limit = int(secs)

    args.out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # this run's files only: no stale results from an earlier run
        (args.out / name).unlink(missing_ok=True)
    for name in ("tests.log", "failures.txt"):  # pytest_stream appends to them
        (args.out / name).touch()
    c = Check(args, steps)
    c.write_summary()

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)

    env = c.env
    env.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-jit")  # JIT builds kept while the machine lives
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"  # every child's output reaches its log line by line
    status = None
    try:
        c.notes.append(f"wheels: {install_wheels(c)}")
        # --site for the steps (and for this script's find_spec of xdist/pytest_timeout); tools/ for -p pytest_stream
        sys.path.insert(0, str(args.site))
        env["PYTHONPATH"] = os.pathsep.join([str(args.site), str(ROOT), str(TOOLS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for name in steps:
            row, step = c.rows[name], STEPS[name]
            if status is not None:
                row["verdict"] = f"not run ({status})"
                continue
            limit = min(step.limit, c.left() - KILL_GRACE)
            row["limit"] = max(limit, 0)
            if limit < min(step.minimum, step.limit):  # an explicit --limit below the minimum is kept
                row["verdict"], row["what"] = "SKIPPED", f"budget: {max(c.left(), 0):.0f} s left, needs {step.minimum} s"
                continue
            c.current = name
            t0 = c.step_t0 = time.monotonic()
            row["verdict"] = "running"
            c.write_summary()
            print(f"[gpu-check] {name} (limit {limit:.0f} s) ...", flush=True)
            try:
                row["verdict"], row["what"] = step.fn(c, limit)
            except Stopped:
                raise
            except Exception as e:  # noqa: BLE001 - one broken step must not hide the others' results
                row["verdict"], row["what"] = "FAILED", f"{type(e).__name__}: {e}"
            row["secs"], c.current = time.monotonic() - t0, None
            print(f"[gpu-check] {name}: {row['verdict']} ({row['secs']:.0f} s) {row['what']}", flush=True)
            c.write_summary()
            if name == "env" and row["verdict"] != "ok":
                status = "env failed"  # no GPU (or no torch): nothing else can mean anything
    except Stopped as e:  # the step's group was killed on the way out of Check.sh
        if c.current:
            c.rows[c.current].update(verdict=f"STOPPED ({e})", secs=time.monotonic() - c.step_t0)
        for row in c.rows.values():
            if row["verdict"] == "pending":
                row["verdict"] = f"not run ({e})"
        c.write_summary(f"stopped by {e}")
        print((args.out / "summary.md").read_text(), flush=True)
        return 130
    ok = all(r["verdict"] in ("ok", "skipped") for r in c.rows.values()) and not any("FAILED" in n for n in c.notes)
    c.write_summary("passed" if ok else "FAILED")
    print((args.out / "summary.md").read_text(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
