"""Decode attention over a paged KV cache: the Triton op vs the torch reference op vs dense SDPA.

    .venv/bin/python bench/attention_kernels.py [--dtype float16] [--page-size 16]
    TRITON_INTERPRET=1 .venv/bin/python bench/attention_kernels.py --smoke   # CPU: code path only

SmolLM2 shapes (9 query / 3 KV heads, D=64), one decode step (each sequence adds one token) at
batch 1/8/32 with 128..2048 tokens cached. Microseconds per call, medians; "eager" is
``triton.testing.do_bench`` (includes Python/launch overhead: 4 Triton launches + a few small
torch ops per call), "graph" is ``do_bench_cudagraph`` (the op replayed in a CUDA graph, i.e.
GPU time, which is how the runtime will call it):

- ``triton``: ``torch.ops.workbench.triton_cached_attention`` (cache write + decode, split-K as
  the op picks it), eager and graph; ``1-split``: graph, split-K off, to show what it buys.
- ``torch op``: ``torch.ops.workbench.torch_cached_attention`` (the reference; it reads lengths
  on the host, so eager only), when registered.
- ``sdpa``: graph, ``F.scaled_dot_product_attention`` on the equivalent dense layout
  (q [B, 9, 1, 64], k/v [B, 3, ctx+1, 64], enable_gqa): no paging, no cache write.

Ratios (> 1: triton faster): ``torch/tr`` = torch op / triton eager; ``sdpa/tr`` and
``1split/tr`` against triton graph. ``GB/s``: K/V bytes read / triton graph time.
Without a CUDA GPU the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
import torch.nn.functional as F

import workbench.ops  # noqa: F401  (registers the canonical ops)
# import_module, not `from ... import`: once the package re-exports the op under the same name,
# the package attribute is the op, not this module.
tca = importlib.import_module("workbench.ops.attention.triton_cached_attention")

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M


def decode_inputs(batch: int, ctx: int, page_size: int, dtype, device) -> dict:
    """One decode step: sequence i has ``ctx`` tokens cached and adds one; pages shuffled."""
    pages_per_seq = -(-(ctx + 1) // page_size)
    perm = torch.randperm(batch * pages_per_seq, device=device).to(torch.int32)
    cache = lambda: torch.randn(batch * pages_per_seq, page_size, HKV, D, dtype=dtype, device=device)
    return dict(
        q=torch.randn(1, batch, HQ, D, dtype=dtype, device=device),
        k=torch.randn(1, batch, HKV, D, dtype=dtype, device=device),
        v=torch.randn(1, batch, HKV, D, dtype=dtype, device=device),
        k_cache=cache(), v_cache=cache(),
        seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
        input_pos=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        page_table=perm.view(batch, pages_per_seq), num_prefill=0, scale=D ** -0.5,
    )


def dense_inputs(batch: int, ctx: int, dtype, device):
    q = torch.randn(batch, HQ, 1, D, dtype=dtype, device=device)
    kv = [torch.randn(batch, HKV, ctx + 1, D, dtype=dtype, device=device) for _ in range(2)]
    return q, *kv


def timers(device):
    """(eager, graph) callables fn -> microseconds; on the interpreter both are a best-of-3."""
    if device == "cuda":
        import triton.testing

        return (lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
                lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))

    def cpu(fn):
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return 1e6 * best

    return cpu, cpu


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the code path, "
                         "timings meaningless")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    if args.smoke:
        device, batches, contexts = "cpu", (1, 2), (32,)
    elif torch.cuda.is_available():
        device, batches, contexts = "cuda", (1, 8, 32), (128, 512, 1024, 2048)
    else:
        print("bench/attention_kernels.py needs a CUDA GPU (the Triton decode kernel is only timed "
              "compiled); run with --smoke under TRITON_INTERPRET=1 to exercise the code on CPU.")
        return 0
    ok, why = tca.is_available(device)
    if not ok:
        print(f"triton_cached_attention unavailable on {device}: {why}")
        return 0
    has_torch_op = hasattr(torch.ops.workbench, "torch_cached_attention")
    eager, graph = timers(device)
    torch.manual_seed(0)

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"{name}, {args.dtype}, Hq={HQ} Hkv={HKV} D={D}, page_size={args.page_size}; us per call")
    print(f"{'batch':>5} {'ctx':>5} | {'triton':>7} {'graph':>7} {'1-split':>7} {'torch op':>8} "
          f"{'sdpa':>7} | {'torch/tr':>8} {'sdpa/tr':>7} {'1split/tr':>9} {'GB/s':>6}")
    for batch in batches:
        for ctx in contexts:
            inp = decode_inputs(batch, ctx, args.page_size, dtype, device)
            op = lambda: torch.ops.workbench.triton_cached_attention(**inp)
            t_eager, t_graph = eager(op), graph(op)
            t_one = graph(lambda: tca.cached_attention_forward(**inp, num_splits=1))
            t_ref = float("nan")
            if has_torch_op:
                t_ref = eager(lambda: torch.ops.workbench.torch_cached_attention(**inp))
            q, k, v = dense_inputs(batch, ctx, dtype, device)
            t_sdpa = graph(
                lambda: F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True))
            gbs = 2 * batch * (ctx + 1) * HKV * D * inp["k_cache"].element_size() / (t_graph * 1e3)
            print(f"{batch:>5} {ctx:>5} | {t_eager:>7.1f} {t_graph:>7.1f} {t_one:>7.1f} {t_ref:>8.1f} "
                  f"{t_sdpa:>7.1f} | {t_ref / t_eager:>8.2f} {t_sdpa / t_graph:>7.2f} "
                  f"{t_one / t_graph:>9.2f} {gbs:>6.1f}")
    if not has_torch_op:
        print("torch op: torch.ops.workbench.torch_cached_attention is not registered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
