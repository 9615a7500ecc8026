"""``make gpu-check``: every GPU test and the GPU decode benchmark on a machine with a preinstalled
CUDA torch and no network, results written to one folder.

    make wheelhouse                      # where pip works: the missing pure-Python deps + FlashInfer
    make gpu-check OUT=/tmp/gpu-out      # on the GPU machine (python3 there holds CUDA torch)
    make gpu-check OUT=... GPU_CHECK_STEPS=tests,flashinfer-jit   # a subset, e.g. to fit a time limit

Steps (``--steps``, in this order): ``env`` (device and versions), ``export`` (tools/export_report.py
on the tiny archs with this torch), ``flashinfer-jit`` (first vs second call of the FlashInfer
kernels: JIT build time apart from run time), ``tests`` (``pytest -m gpu``; a skip fails the check
unless its reason names a missing optional package), ``bench-smollm2`` and ``bench-llama3``
(bench/decode.py with random bf16 weights of the real configs). Each step's log goes to
``<out>/<step>.log``; ``<out>/summary.md`` collects the verdicts, and the exit status is non-zero
if any step failed. The wheels are installed with ``--target`` into a folder of their own, so the
preinstalled torch/triton are never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("env", "export", "flashinfer-jit", "tests", "bench-smollm2", "bench-llama3")
ALLOWED_SKIP = "optional package missing"
# pytest.importorskip's reason when a test module needs a package the GPU image lacks (ipywidgets...)
ALLOWED_SKIPS = (ALLOWED_SKIP, "could not import")


def install_wheels(wheelhouse: Path, site: Path) -> str:
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    if not wheels:
        return f"no wheels in {wheelhouse} (run `make wheelhouse` where pip works)"
    site.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *wheels], check=True)
    return f"installed {len(wheels)} wheels into {site}"


def run(cmd: List[str], log: Path, env: Dict[str, str], timeout: int) -> Tuple[int, float]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu_check] timed out after {timeout}s\n")
            rc = 124
    return rc, time.perf_counter() - t0


def step_env(out: Path, env: Dict[str, str], args) -> Tuple[bool, str]:
    code = (
        "import json, platform, torch, transformers\n"
        "info = {'python': platform.python_version(), 'torch': torch.__version__,\n"
        "        'cuda': torch.version.cuda, 'transformers': transformers.__version__,\n"
        "        'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None}\n"
        "from importlib import metadata\n"
        "for name in ('triton', 'flashinfer-python', 'pydantic', 'gguf', 'graphviz'):\n"
        "    try:\n"
        "        info[name] = metadata.version(name)\n"
        "    except Exception as e:\n"
        "        info[name] = f'missing ({type(e).__name__})'\n"
        "print(json.dumps(info))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    (out / "env.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return False, proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    (out / "env.json").write_text(json.dumps(info, indent=1))
    if info["gpu"] is None and not args.dry_run_on_cpu:
        return False, f"no CUDA device visible to torch {info['torch']}: make gpu-check needs a GPU machine"
    return True, ", ".join(f"{k} {v}" for k, v in info.items())


def step_export(out: Path, env: Dict[str, str], args) -> Tuple[bool, str]:
    rc, secs = run([sys.executable, "tools/export_report.py", "--new-tokens", "8",
                    *[f"tiny:{a}" for a in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")]],
                   out / "export.log", env, args.timeout)
    return rc == 0, f"rc {rc} in {secs:.0f}s (JSON report at the end of export.log)"


FLASHINFER_JIT = r"""
import json, time, torch
import flashinfer
out = {}
x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16); w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
for name, fn in (
    ("rmsnorm", lambda: flashinfer.norm.rmsnorm(x, w, 1e-6)),
    ("single_decode", lambda: flashinfer.single_decode_with_kv_cache(
        torch.randn(32, 128, device="cuda", dtype=torch.bfloat16),
        torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16),
        torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16))),
):
    times = []
    for _ in range(2):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out[name] = {"first_call_s (JIT build + run)": round(times[0], 2), "second_call_ms": round(times[1] * 1e3, 3)}
print(json.dumps(out))
"""


def step_flashinfer_jit(out: Path, env: Dict[str, str], args) -> Tuple[bool, str]:
    probe = subprocess.run([sys.executable, "-c", "import flashinfer"], capture_output=True, env=env)
    if probe.returncode:
        return True, f"skipped: {ALLOWED_SKIP}: flashinfer-python (not in the wheelhouse)"
    rc, secs = run([sys.executable, "-c", FLASHINFER_JIT], out / "flashinfer-jit.log", env, args.timeout)
    tail = (out / "flashinfer-jit.log").read_text().strip().splitlines()[-1]
    return rc == 0, f"rc {rc}: {tail}"


def step_tests(out: Path, env: Dict[str, str], args) -> Tuple[bool, str]:
    xml = out / "gpu-tests.xml"
    rc, secs = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "tests"], out / "tests.log", env, args.timeout)
    if not xml.exists():
        return False, f"rc {rc}: pytest wrote no report"
    root = ET.parse(xml).getroot()
    suite = root.find("testsuite") if root.find("testsuite") is not None else root
    bad_skips, allowed = [], []
    for case in suite.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            why = skip.get("message", "")
            name = f"{case.get('classname')}::{case.get('name')}"
            (allowed if any(a in why for a in ALLOWED_SKIPS) else bad_skips).append(f"{name}: {why[:160]}")
    counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    (out / "tests-skips.txt").write_text("\n".join(["NOT ALLOWED:", *bad_skips, "", "ALLOWED:", *allowed]) + "\n")
    ok = rc in (0,) and not bad_skips and counts["tests"] not in (None, "0")
    if rc == 5:
        return False, "pytest collected no GPU tests"
    return ok, (f"{counts} in {secs:.0f}s; {len(bad_skips)} skip(s) not allowed on a GPU machine, "
                f"{len(allowed)} for missing optional packages (tests-skips.txt)")


def _bench(shape: str, batches: List[str]) -> Callable:
    def step(out: Path, env: Dict[str, str], args) -> Tuple[bool, str]:
        device = ["--device", "cpu", "--dtype", "float32", "--model", "tiny:llama", "--new-tokens", "8",
                  "--prompt-len", "16"] if args.dry_run_on_cpu else ["--device", "cuda", "--dtype", "bfloat16",
                                                                       "--model", f"shape:{shape}"]
        name = f"bench-{shape.split('-')[0]}"
        rc, secs = run([sys.executable, "bench/decode.py", *device, "--batch-sizes", *batches],
                       out / f"{name}.log", env, args.timeout)
        return rc == 0, f"rc {rc} in {secs:.0f}s (table in {name}.log)"
    return step


STEP_FNS = {
    "env": step_env, "export": step_export, "flashinfer-jit": step_flashinfer_jit, "tests": step_tests,
    "bench-smollm2": _bench("smollm2", ["1", "8"]), "bench-llama3": _bench("llama3-8b", ["1"]),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / ".whl")
    ap.add_argument("--site", type=Path, default=Path("/tmp/workbench-gpu-site"))
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per step")
    ap.add_argument("--dry-run-on-cpu", action="store_true",
                    help="exercise this script on a CPU machine (GPU tests skip, benchmarks on tiny:llama)")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEP_FNS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    lines = [f"# gpu-check {time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node()}", ""]
    try:
        lines.append(f"- wheels: {install_wheels(args.wheelhouse, args.site)}")
        env["PYTHONPATH"] = os.pathsep.join([str(args.site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    except subprocess.CalledProcessError as e:
        lines.append(f"- wheels: FAILED to install ({e})")
    env.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-jit")  # JIT builds kept while the machine lives
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    failed = []
    for name in steps:
        print(f"[gpu-check] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            ok, what = STEP_FNS[name](args.out, env, args)
        except Exception as e:  # noqa: BLE001 - one broken step must not hide the others' results
            ok, what = False, f"{type(e).__name__}: {e}"
        verdict = "ok" if ok else "FAILED"
        lines.append(f"- {name}: {verdict} ({time.perf_counter() - t0:.0f}s) {what}")
        print(lines[-1], flush=True)
        if not ok:
            failed.append(name)
            if name == "env":
                break  # no GPU (or no torch): nothing else can mean anything
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
