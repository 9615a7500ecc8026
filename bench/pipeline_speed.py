"""What snapshots cost: export + the default pipeline on a model, snapshots on vs off, in one run.

    .venv/bin/python bench/pipeline_speed.py [--model smollm2] [--repeats 2]

Prints wall times (best of --repeats, modes interleaved so machine noise hits both alike), the
time ratio (target <= 1.10), and the Python memory retained by the snapshots (graph copies,
histograms, provenance; measured with tracemalloc in a separate pass) as a fraction of the model's
parameter bytes (target <= 5%). The numerics probe is reported separately: it is a switch of its own.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

from workbench import Workbench, load_model

MODES = {
    "off": dict(snapshots=False, numerics=False),
    "snapshots": dict(snapshots=True, numerics=False),
    "snapshots+numerics": dict(snapshots=True, numerics=True),
}


def run_once(loaded, **kw) -> float:
    t0 = time.perf_counter()
    wb = Workbench(loaded, **kw)
    wb.run()
    return time.perf_counter() - t0


def retained_bytes(loaded, **kw) -> int:
    gc.collect()
    tracemalloc.start()
    wb = Workbench(loaded, **kw)
    wb.run()
    gc.collect()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del wb
    return current


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    loaded = load_model(args.model)
    model_bytes = loaded.parameter_bytes
    run_once(loaded, **MODES["off"])  # warm-up: first export pays one-time import/trace costs

    times = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode, kw in MODES.items():
            times[mode].append(run_once(loaded, **kw))
    best = {m: min(v) for m, v in times.items()}

    mem_off = retained_bytes(loaded, **MODES["off"])
    mem_on = retained_bytes(loaded, **MODES["snapshots"])
    overhead = mem_on - mem_off

    wb = Workbench(loaded, snapshots=True, numerics=False)
    wb.run()
    n_snaps = len(wb.snapshots)
    n_nodes = wb.snapshots[0].num_nodes

    print(f"model: {args.model}  params+buffers: {model_bytes / 2**20:.1f} MiB  "
          f"snapshots: {n_snaps}  exported nodes: {n_nodes}")
    print(f"{'mode':22s} {'best s':>8s}  all runs")
    for mode in MODES:
        print(f"{mode:22s} {best[mode]:8.2f}  {', '.join(f'{t:.2f}' for t in times[mode])}")
    t_ratio = best["snapshots"] / best["off"]
    n_ratio = best["snapshots+numerics"] / best["off"]
    m_ratio = overhead / model_bytes
    print(f"time ratio snapshots/off:          {t_ratio:.3f}  (target <= 1.10: "
          f"{'met' if t_ratio <= 1.10 else 'NOT met'})")
    print(f"time ratio snapshots+numerics/off: {n_ratio:.3f}")
    print(f"snapshot memory: {overhead / 2**20:.2f} MiB = {m_ratio:.2%} of model bytes "
          f"(target <= 5%: {'met' if m_ratio <= 0.05 else 'NOT met'})")


if __name__ == "__main__":
    main()
