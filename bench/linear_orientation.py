"""CPU fp32 linears three ways, on cold weights: what ``linear_weight_layout`` chooses between.

    .venv/bin/python bench/linear_orientation.py            # SmolLM2's shapes, M = 1 8 32

One pass = every linear of a SmolLM2-shaped model (q/k/v fused 960 x 576, o 576 x 576, gate/up
fused 3072 x 576, down 576 x 1536, over 30 layers) plus the 49,152 x 576 LM head: 513 MiB of
fp32 weights, far more than the caches, so every pass streams them from memory as a decode step
does. Printed: ms per pass (best of 5) for

* ``linear``: ``F.linear(x, W)`` on ``W [N, K]`` as loaded (``layout: nk``)
* ``kn``:     ``x @ W_kn`` on a transposed copy ``[K, N]`` (``layout: kn``)
* ``wxt``:    ``cpu_linear_wxt(x, W)`` = ``(W @ x.T).T`` on ``W`` as loaded (``layout: wxt``)

and the ratios of the first two to ``wxt``, all in this one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench.ops.mlp.cpu_linear_wxt import linear_wxt  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) per layer
HEAD = (576, 49152)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="M: sequences per decode step")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    nk = [torch.randn(n, k, generator=g) for _ in range(args.layers) for k, n in SHAPES]
    nk.append(torch.randn(HEAD[1], HEAD[0], generator=g))
    kn = [w.t().contiguous() for w in nk]
    variants = {
        "linear": lambda x, i: F.linear(x[nk[i].shape[1]], nk[i]),
        "kn": lambda x, i: torch.mm(x[nk[i].shape[1]], kn[i]),
        "wxt": lambda x, i: linear_wxt(x[nk[i].shape[1]], nk[i]),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(w.numel() for w in nk) * 4 / 2**20:.0f} MiB of fp32 weights per pass")
    print(f"{'M':>4} " + " ".join(f"{v:>9}" for v in variants) + "   linear/wxt  kn/wxt")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        ms = {}
        with torch.no_grad():
            for name, fn in variants.items():
                best = float("inf")
                for rep in range(6):  # the first pass warms up
                    t0 = time.perf_counter()
                    for i in range(len(nk)):
                        fn(xs, i)
                    if rep:
                        best = min(best, time.perf_counter() - t0)
                ms[name] = best * 1e3
        print(f"{m:>4} " + " ".join(f"{ms[v]:9.1f}" for v in variants)
              + f"   {ms['linear'] / ms['wxt']:10.2f} {ms['kn'] / ms['wxt']:7.2f}")
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
