"""Sharded decode: tokens/s and the collectives' time per decode step, world size 1 vs 2.

    .venv/bin/python bench/sharding.py                          # smollm2 (Q4_1), CPU ranks on gloo
    .venv/bin/python bench/sharding.py --model tiny:qwen3_moe --batch-sizes 1 4
    python bench/sharding.py --device cuda --world-sizes 1 2     # NCCL, one GPU per rank

Each world size runs in its own rank processes (world size 1 too, so both pay the same start-up),
with ``os.cpu_count() // world_size`` threads per rank: on the 2-core CPU machine both use the two
cores, so this is a correctness-and-overhead figure, not a speed-up claim. Every rank builds the
whole default pipeline (numerics off) for its shard, then per batch size: one warm-up generate,
one timed generate (decode tokens/s from the runtime's decode-only steps, rank 0's), and one
generate under ``torch.profiler`` that sums the time spent in the ``torch_dist_*`` collective ops
per step (the profiler's per-op CPU time: on CPU this includes waiting for the slower rank).
Greedy tokens of world size 2 are checked against world size 1 on the same prompts.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COLLECTIVES = ("workbench::torch_dist_all_reduce", "workbench::torch_dist_all_gather")


def collective_ms(prof) -> float:
    return sum(e.cpu_time_total for e in prof.key_averages() if e.key in COLLECTIVES) / 1e3


def rank_main(rank: int, world_size: int, init_method: str, args, out_path: str) -> None:
    from workbench import Workbench
    from workbench.parallel.group import (GroupSpec, backend_for, destroy_group, init_group, rank_device,
                                          threads_per_rank)

    torch.set_num_threads(threads_per_rank(world_size))

    device = rank_device(args.device, rank)
    dist = None
    if world_size > 1:
        dist = init_group(rank, GroupSpec(world_size, init_method, backend_for(device)), device)
    t0 = time.perf_counter()
    wb = Workbench(args.model, device=device, numerics=False, dist=dist, max_batch_size=max(args.batch_sizes),
                   max_seq_len=args.prompt_len + args.new_tokens + 8)
    wb.run()
    setup_s = time.perf_counter() - t0
    n_coll = sum(1 for n in wb.module.graph.nodes if str(n.target).startswith("workbench.torch_dist"))
    vocab = wb.ctx.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batch_sizes:
        prompts = torch.randint(min(100, vocab // 2), vocab, (b, args.prompt_len), generator=gen).tolist()
        kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=[])
        wb.generate(prompts, max_new_tokens=4, stop_token_ids=[])  # warm-up
        out = wb.generate(prompts, **kw)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            prof_out = wb.generate(prompts, **kw)
        steps = max(1, prof_out.stats.steps)
        rows.append(dict(batch=b, decode_tok_s=out.stats.decode_tokens_per_s, steps=out.stats.steps,
                         collectives_per_step=n_coll, collective_ms_per_step=collective_ms(prof) / steps,
                         step_ms=1e3 * out.stats.total_s / max(1, out.stats.steps), tokens=out.token_ids))
    if rank == 0:
        torch.save(dict(setup_s=setup_s, rows=rows, plan=wb.ctx.sharding.counts() if wb.ctx.sharding else {}),
                   out_path)
    if world_size > 1:
        destroy_group()


def run_world(world_size: int, args) -> dict:
    from workbench.parallel.group import FileRendezvous

    rdv = FileRendezvous()
    out = rdv.directory / "result.pt"
    try:
        mp.start_processes(rank_main, args=(world_size, rdv.init_method, args, str(out)), nprocs=world_size,
                           start_method="spawn")
        return torch.load(out)
    finally:
        rdv.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny:<arch> | a local HF dir")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL, one GPU per rank)")
    args = ap.parse_args()

    print(f"# bench/sharding.py: {args.model}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, device {args.device}, prompt {args.prompt_len} + {args.new_tokens} new tokens")
    results = {}
    for ws in args.world_sizes:
        t0 = time.perf_counter()
        results[ws] = run_world(ws, args)
        print(f"world size {ws}: ranks ready and done in {time.perf_counter() - t0:.1f} s "
              f"(pipeline {results[ws]['setup_s']:.1f} s on rank 0; split regions {results[ws]['plan']})", flush=True)
    base = results.get(1)
    print("\n| world size | batch | decode tok/s | x world size 1 | collectives / step | collective ms / step "
          "| step ms | share of step | tokens == world size 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ws, res in results.items():
        for i, row in enumerate(res["rows"]):
            ref = base["rows"][i] if base else None
            ratio = f"{row['decode_tok_s'] / ref['decode_tok_s']:.2f}" if ref else "-"
            same = "-" if ref is None or ws == 1 else ("yes" if row["tokens"] == ref["tokens"] else "NO")
            share = row["collective_ms_per_step"] / row["step_ms"] if row["step_ms"] else 0.0
            print(f"| {ws} | {row['batch']} | {row['decode_tok_s']:.1f} | {ratio} | {row['collectives_per_step']} | "
                  f"{row['collective_ms_per_step']:.2f} | {row['step_ms']:.2f} | {share:.0%} | {same} |")


if __name__ == "__main__":
    main()
