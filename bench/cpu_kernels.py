"""The C++ CPU kernels per build (AVX-512 + VNNI, AVX-512, AVX2, NEON...) against torch's own ops, side by side.

    .venv/bin/python bench/cpu_kernels.py                  # every build this CPU runs, 3 alternated rounds
    .venv/bin/python bench/cpu_kernels.py --variants avx2 --rounds 5 --threads 1

A process loads one build of the kernels, so each measurement is a child process with
``WORKBENCH_CPU_ISA`` set to its build; the builds are alternated round by round (this machine's
memory bandwidth drifts by tens of percent within minutes) and the median per row is printed.

Workloads: SmolLM2-135M's decode-step shapes at batch 1, each layer's weights in memory of their
own (30 layers, weights streamed from memory as in a decode step, not cache-resident):

    int4 linears      120 x Q4_1 [960|576|3072, 576] + [576, 1536]   cpu_int4_linear (exact fp32
                      activations), cpu_int4_linear_a8 (int8 activations), torch's ops on the
                      weights dequantized once (aten.linear: what runs where no kernel builds)
    int8 LM head      Q8_0 [49152, 576]                               cpu_int8_linear
    fp32 linears      the same shapes in fp32 (513 MiB)                cpu_linear, aten.linear, cpu_linear_wxt
    attention         30 layers, 9 / 3 heads, head dim 64, 256 keys   cpu_cached_attention, torch_cached_attention

Each cell: ms per pass over the workload (best of 3 passes in the child, median over rounds); the
last columns give the ratio of torch's op to the kernel (>1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def best(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    t_best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best


def child() -> Dict[str, float]:
    """One measurement of every row in this process's build (``WORKBENCH_CPU_ISA``)."""
    import torch

    import workbench.ops  # noqa: F401 - registers every op
    from workbench.ops import cpu_kernels
    from workbench.ops.quant import dequantize_int4, dequantize_int8

    kernels = cpu_kernels.load() is None
    W = torch.ops.workbench
    g = torch.Generator().manual_seed(0)
    out: Dict[str, float] = {}
    with torch.no_grad():
        layers = []
        for _ in range(LAYERS):
            for n, k in SHAPES:
                q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
                s = (torch.rand(n, k // 32, generator=g) * 0.02).half()
                o = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).half()
                layers.append((torch.randn(1, k, generator=g), q, s, o))
        if kernels:
            out["int4 exact"] = best(lambda: [W.cpu_int4_linear(x, q, s, o, 32) for x, q, s, o in layers])
            out["int4 int8 act"] = best(lambda: [W.cpu_int4_linear_a8(x, q, s, o, 32) for x, q, s, o in layers])
        dense = [(x, dequantize_int4(q, s, o, 32)) for x, q, s, o in layers]
        del layers
        out["int4 dequantized, aten.linear"] = best(lambda: [torch.nn.functional.linear(x, w) for x, w in dense])
        if kernels:
            out["fp32 cpu_linear"] = best(lambda: [W.cpu_linear(x, w) for x, w in dense])
        out["fp32 aten.linear"] = best(lambda: [torch.nn.functional.linear(x, w) for x, w in dense])
        out["fp32 cpu_linear_wxt"] = best(lambda: [W.cpu_linear_wxt(x, w) for x, w in dense])
        del dense
        lm_q = torch.randint(-128, 128, (49152, 576), dtype=torch.int8, generator=g)
        lm_s = (torch.rand(49152, 18, generator=g) * 0.01).half()
        x = torch.randn(1, 576, generator=g)
        if kernels:
            out["int8 LM head"] = best(lambda: W.cpu_int8_linear(x, lm_q, lm_s, 32))
        lm = dequantize_int8(lm_q, lm_s, 32)
        out["int8 LM head dequantized, aten.linear"] = best(lambda: torch.nn.functional.linear(x, lm))
        del lm
        hq, hkv, d, keys, page = 9, 3, 64, 256, 16
        pages = keys // page + 1
        caches = [(torch.randn(pages, page, hkv, d, generator=g), torch.randn(pages, page, hkv, d, generator=g))
                  for _ in range(LAYERS)]  # fmt: skip
        q, kn, vn = (torch.randn(1, 1, h, d, generator=g) for h in (hq, hkv, hkv))
        meta = (torch.ones(1, dtype=torch.int32), torch.tensor([keys - 1], dtype=torch.int32),
                torch.arange(pages, dtype=torch.int32)[None], 0, d**-0.5)  # fmt: skip
        if kernels:
            out["attention cpu_cached_attention"] = best(
                lambda: [W.cpu_cached_attention(q, kn, vn, kc, vc, *meta) for kc, vc in caches])
        out["attention torch_cached_attention"] = best(
            lambda: [W.torch_cached_attention(q, kn, vn, kc, vc, *meta) for kc, vc in caches])
    return out


PAIRS = [  # (kernel row, torch row): the ratio columns
    ("int4 exact", "int4 dequantized, aten.linear"),
    ("int4 int8 act", "int4 dequantized, aten.linear"),
    ("fp32 cpu_linear", "fp32 aten.linear"),
    ("int8 LM head", "int8 LM head dequantized, aten.linear"),
    ("attention cpu_cached_attention", "attention torch_cached_attention"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=None, help="builds to measure (default: every one this CPU runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(child()))
        return
    sys.path.insert(0, str(ROOT))
    import torch

    from workbench.ops.cpu_kernels import isa

    arch, features = isa.machine_arch(), isa.cpu_features()
    variants = args.variants or [v.name for v in isa.VARIANTS if v.arch == arch and not v.missing(features)]
    flags = sorted(f for f in features if f.startswith(("avx", "fma", "f16c", "amx", "asimd", "sve")))
    print(f"cpu {isa.cpu_model() or arch}; flags {' '.join(flags)}")
    print(f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads; builds {', '.join(variants)}; "
          f"{args.rounds} alternated rounds", flush=True)
    runs: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            cmd = [sys.executable, __file__, "--child"] + (["--threads", str(args.threads)] if args.threads else [])
            done = subprocess.run(cmd, env={**os.environ, isa.ENV: v}, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{v}: the child failed:\n{done.stderr[-2000:]}")
            runs[v].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {v}: " + ", ".join(f"{k} {t * 1e3:.2f}" for k, t in runs[v][-1].items()), flush=True)
    rows = sorted({k for v in variants for run in runs[v] for k in run}, key=lambda k: (k.split()[0], k))
    med = {v: {k: statistics.median(run[k] for run in runs[v]) for k in rows if k in runs[v][0]} for v in variants}
    print("\nms per pass, median of the rounds")
    print(f"{'row':42s}" + "".join(f"{v:>14s}" for v in variants))
    for k in rows:
        print(f"{k:42s}" + "".join(f"{med[v][k] * 1e3:14.2f}" if k in med[v] else f"{'-':>14s}" for v in variants))
    print("\ntorch's op / the kernel (>1: the kernel is faster)")
    for kernel, ref in PAIRS:
        cells = [f"{med[v][ref] / med[v][kernel]:14.2f}" if kernel in med[v] else f"{'-':>14s}" for v in variants]
        print(f"{kernel + ' vs ' + ref.split(' ', 1)[1]:42s}"[:42] + "".join(cells))
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
