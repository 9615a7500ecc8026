"""Host time of one decode step of the runtime, with no model: where the microseconds go.

Drives the real decode loop (``workbench.runtime.generate`` with ``profile_steps=True``) through a
``CachedRunner`` whose module returns ready logits at once, over the paged KV cache of the SmolLM2
shape (30 layers, 3 KV heads of 64, vocabulary 49152, pages of 16 tokens). What is left is the
host's share of a step that a CUDA graph cannot hide: scheduling, filling the step's input buffers,
calling the runner, choosing the next tokens, and the per-sequence bookkeeping.

    python bench/step_overhead.py [--batch-sizes 1 8 64] [--prompt-len 128] [--new-tokens 64] [--repeats 3]

Prints one row per batch size: the median microseconds per decode step of each part (median over
decode-only steps, then the median of ``--repeats`` runs):
``schedule`` (Scheduler.schedule), ``prepare`` (CachedRunner.set_step: tokens, positions, page
table into the SequenceInfo buffers), ``call`` (the module call, here returning at once),
``gather`` (the rest of the runner call: picking each sequence's logits row), ``sample`` (greedy
argmax and the tokens to the host), ``bookkeeping`` (appending tokens, stop checks, freeing
finished sequences) and ``total`` (one step, end to end).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any, Dict, List

import torch

from workbench.runtime.kv_cache import PAGED, CacheSpec, KVCacheConfig
from workbench.runtime.runner import CachedRunner
from workbench.runtime.generate import generate
from workbench.runtime.sequence_info import LAST_TOKEN_INPUT, METADATA_INPUTS, TOKEN_INPUTS

# SmolLM2-135M: 30 decoder layers, 3 KV heads of head dim 64, vocabulary 49152.
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 30, 3, 64, 49152
PARTS = ("schedule", "prepare", "call", "gather", "sample", "bookkeeping", "total")


class ReadyLogits(torch.nn.Module):
    """A cached module's contract (token inputs, metadata, last-token index, caches in) that
    returns fixed logits [1, max_batch_size, V] at once: the model costs nothing."""

    def __init__(self, specs: List[CacheSpec], max_batch_size: int):
        super().__init__()
        self.input_names = [*TOKEN_INPUTS, *METADATA_INPUTS, LAST_TOKEN_INPUT, *[s.name for s in specs]]
        gen = torch.Generator().manual_seed(0)
        self.logits = torch.randn(1, max_batch_size, VOCAB, generator=gen)

    def forward(self, *inputs: Any) -> torch.Tensor:
        return self.logits


class TimedRunner(CachedRunner):
    """CachedRunner that notes how long filling the inputs and the module call took."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parts: List[Dict[str, float]] = []
        inner = self.fn

        def timed_fn(*inputs: Any) -> torch.Tensor:
            t = time.perf_counter()
            out = inner(*inputs)
            self.parts[-1]["call"] = (time.perf_counter() - t) * 1e6
            return out

        self.fn = timed_fn

    def set_step(self, step, sched) -> None:
        t = time.perf_counter()
        super().set_step(step, sched)
        self.parts.append({"prepare": (time.perf_counter() - t) * 1e6, "decode": step.num_prefill == 0})


def make_runner(batch: int, prompt_len: int, new_tokens: int) -> TimedRunner:
    """A runner over a paged pool sized for ``batch`` sequences of prompt + new tokens."""
    seq_len = prompt_len + new_tokens
    page = 16
    pages = batch * -(-seq_len // page) + 1
    specs = [CacheSpec(f"{kv}_cache_{i}", PAGED, (KV_HEADS, HEAD_DIM), None, i) for i in range(LAYERS) for kv in "kv"]
    cfg = KVCacheConfig.sized(page_size=page, num_pages=pages, dtype=torch.bfloat16, max_batch_size=batch,
                              max_seq_len=seq_len, max_num_tokens=max(2048, batch), specs=specs)
    caches = {s.name: torch.zeros(s.tensor_shape(cfg), dtype=cfg.dtype) for s in specs}
    return TimedRunner(ReadyLogits(specs, batch), caches, cfg)


def measure(batch: int, prompt_len: int, new_tokens: int) -> Dict[str, float]:
    """Median microseconds per decode step of each part, over one generate of ``batch`` prompts."""
    runner = make_runner(batch, prompt_len, new_tokens)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    out = generate(runner, prompts, max_new_tokens=new_tokens, stop_token_ids=[], profile_steps=True)
    steps = [p for p in runner.parts if p["decode"]]
    ms = out.stats.decode_step_ms or {}
    prepare = statistics.median(p["prepare"] for p in steps)
    call = statistics.median(p["call"] for p in steps)
    runner_us = ms["runner_host"] * 1e3
    return {
        "schedule": ms["schedule"] * 1e3,
        "prepare": prepare,
        "call": call,
        "gather": max(0.0, runner_us - prepare - call),
        "sample": ms["sample"] * 1e3,
        "bookkeeping": ms["bookkeeping"] * 1e3,
        "total": ms["total"] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch size; the median of their medians")
    args = ap.parse_args()
    print(f"host {platform.machine()} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"SmolLM2 shape: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, vocab {VOCAB}; "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; median us per decode step")
    print(f"{'batch':>5} " + " ".join(f"{p:>11}" for p in PARTS), flush=True)
    for batch in args.batch_sizes:
        runs = [measure(batch, args.prompt_len, args.new_tokens) for _ in range(args.repeats)]
        row = {p: statistics.median(r[p] for r in runs) for p in PARTS}
        print(f"{batch:>5} " + " ".join(f"{row[p]:>11.1f}" for p in PARTS), flush=True)


if __name__ == "__main__":
    main()
