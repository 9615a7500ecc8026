"""JIT-build the FlashInfer kernels the workbench calls, in parallel, and time each build.

flashinfer-python 0.6.18 ships no compiled kernels: each (head dim, dtypes, sliding window on/off,
soft-cap on/off) attention variant and the RMSNorm module are compiled with nvcc on first use (an
H100 took 33 s for the first rmsnorm, 8.6 s for a first decode). ``make gpu-check`` runs this before
its tests so the builds happen once, side by side, instead of inside whichever test meets them first
(each holding FlashInfer's build lock while its pytest worker waits). The variants are the ones the
GPU tests and the default pipeline use: bfloat16, head dims 64 and 128, plain / windowed / capped.

    python tools/flashinfer_warmup.py [--jobs N]     # one JSON line: seconds per variant, first and second call

Builds land in ``FLASHINFER_WORKSPACE_BASE`` (gpu_check points it at a folder that lives as long as
the machine). Runs through the workbench op itself, so exactly its modules are built.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, head_dim, sliding_window, logit_cap): the attention variants the GPU tests run
ATTENTION_VARIANTS = (("attention hd64", 64, None, None), ("attention hd64 window", 64, 3, None),
                      ("attention hd64 softcap", 64, None, 2.0), ("attention hd128", 128, None, None))


def _attention(head_dim: int, window, cap) -> None:
    import torch

    import workbench.ops  # noqa: F401  (registers the op)

    dev, bf = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, 3, h, head_dim, device=dev, dtype=bf) for h in (6, 2, 2))
    kc, vc = (torch.zeros(4, 16, 2, head_dim, device=dev, dtype=bf) for _ in range(2))
    i32 = dict(dtype=torch.int32, device=dev)
    torch.ops.workbench.flashinfer_cached_attention(
        q, k, v, kc, vc, torch.tensor([2, 1], **i32), torch.tensor([0, 4], **i32),
        torch.tensor([[0, 1], [2, 3]], **i32), 1, head_dim ** -0.5, sliding_window=window, logit_cap=cap)


def _rmsnorm() -> None:
    import torch

    import workbench.ops  # noqa: F401

    x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    torch.ops.workbench.flashinfer_rmsnorm(x, torch.ones(576, device="cuda", dtype=torch.bfloat16), 1e-5)


def _timed(job) -> dict:
    """Call the job twice in this (fresh) process: the first call builds, the second only runs."""
    import torch

    name, fn, args = job
    times = []
    try:
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(*args)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others' timings
        return {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"variant": name, "first_call_s": round(times[0], 2), "second_call_ms": round(times[1] * 1e3, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=len(ATTENTION_VARIANTS) + 1, help="builds run side by side")
    args = ap.parse_args(argv)
    jobs = [(name, _attention, (d, w, c)) for name, d, w, c in ATTENTION_VARIANTS] + [("rmsnorm", _rmsnorm, ())]
    t0 = time.perf_counter()
    # spawn: each build in a fresh process (CUDA cannot be forked once initialised)
    with mp.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
        results = []
        for row in pool.imap_unordered(_timed, jobs):
            print(f"[flashinfer-jit] {json.dumps(row)}", flush=True)  # each build as it finishes
            results.append(row)
    failed = [r for r in results if "error" in r]
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 1), "built": len(results) - len(failed),
                      "failed": [r["variant"] for r in failed]}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
