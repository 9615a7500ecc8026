"""What each node costs, predicted vs measured per op category, at four points of smollm2's pipeline.

    .venv/bin/python bench/cost_table.py [--model smollm2] [--threads 1] [--steps 3]

For ``export_to_gm``, ``fuse_gemms``, ``insert_cached_attention`` and the final graph: the cost model's
GFLOP, MB moved, launches and roofline time per op category on this CPU (its measured GEMV/copy
bandwidth, GEMM rate and per-call time) beside the time torch.profiler measures per category here,
for a decode step (the 512th token; uncached graphs re-run the whole 512-token history, as the
runtime does without a cache) and a 512-token prefill (per token); then the H100 (datasheet)
prediction of the same graphs, and the total per transform across the whole pipeline. This
machine's profile is measured again right before each table (the bandwidth of a shared machine
moves by several times within minutes).
One intra-op thread by default: on a machine shared with other jobs, more threads time erratically
(``workbench.analysis.cost.devices.torch_threads``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench import Workbench  # noqa: E402
from workbench.analysis.cost import (  # noqa: E402
    category_table,
    cost_across_pipeline,
    measure_categories,
    measure_this_cpu,
    node_costs,
)

KEYS = ("export_to_gm", "fuse_gemms", "insert_cached_attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-across", action="store_true", help="skip the per-transform totals")
    args = ap.parse_args()
    pd.set_option("display.width", 200)
    t0 = time.perf_counter()
    wb = Workbench(args.model, device="cpu")
    wb.run()
    print(
        f"# {args.model}: pipeline ran in {time.perf_counter() - t0:.1f} s; {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {args.threads} thread(s)"
    )
    print(f"# this-cpu profile: {measure_this_cpu(args.threads).source}")
    keys = list(KEYS) + [wb.snapshots[-1].key]
    for key in keys:
        gm = wb.snapshot(key).module
        for phase in ("decode", "prefill"):
            # the profile again right before each measurement: on a shared machine the bandwidth
            # moves by several times within minutes, and predicted vs measured should see the same
            measure_this_cpu.cache_clear()
            print(f"\n# this-cpu profile now: {measure_this_cpu(args.threads).source}")
            frame = node_costs(gm, phase, "this-cpu", args.threads)
            measured = measure_categories(wb, key, phase, steps=args.steps, threads=args.threads)
            print(f"\n## {key} ({wb.snapshot(key).num_nodes} nodes), {phase}: predicted vs measured on this CPU")
            print(category_table(frame, phase, measured).round(3).to_string())
    print("\n## H100 (datasheet roofline, bf16 bytes), total per graph")
    for key in keys:
        gm = wb.snapshot(key).module
        d = node_costs(gm, "decode", "h100")
        p = node_costs(gm, "prefill", "h100")
        print(
            f"{key:28s} decode {d['time_s'].sum() * 1e3:8.3f} ms/step   prefill {p['time_s'].sum() * 1e6 / 512:8.3f} us/token"
        )
    if not args.no_across:
        measure_this_cpu.cache_clear()
        print(f"\n# this-cpu profile now: {measure_this_cpu(args.threads).source}")
        print("\n## across the pipeline (this CPU; only rows whose numbers changed)")
        frame = cost_across_pipeline(wb, "this-cpu", measure=True, threads=args.threads)
        cols = [
            "predicted_decode_ms",
            "measured_decode_ms",
            "predicted_prefill_us_per_token",
            "measured_prefill_us_per_token",
        ]
        changed = frame[cols].round(3).ne(frame[cols].round(3).shift()).any(axis=1)
        print(
            frame[changed][["#", "transform", "nodes", "launches", "decode_GFLOP", "decode_MB"] + cols]
            .round(3)
            .to_string(index=False)
        )
    print(f"\n# total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
