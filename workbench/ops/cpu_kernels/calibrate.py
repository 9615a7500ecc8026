"""What ``auto`` picks on a CPU, measured on that CPU: short timings once per machine, kernel build,
torch, thread count and workload, cached in ``$WORKBENCH_CACHE_DIR/calibration``.

Which spelling streams a decode step's weights fastest depends on the CPU, its caches and its BLAS
more than on anything a table could hold: on this project's Xeon MKL's ``aten.linear`` at batch 1
reads fp32 weights as fast as the C++ kernel while ``(W @ x.T).T`` (the fixed fallback of earlier
versions) takes 2.7x as long; the int4 kernel with exact fp32 activations is bound by its
instruction count on the AVX2 build, so int8 activations (llama.cpp's Q8_1) pay more there. So each
choice is timed where it is made, on the workload it is for:

    choice              candidates                                            timed on
    fp32 linears        kernel (cpu_linear) | wxt (MKL, W @ x.T) | nk (aten)  the model's fp32 linears
    int4 activations    fp32 (cpu_int4_linear) | int8 (cpu_int4_linear_a8)    the model's int4 linears
    attention           cpu (cpu_cached_attention) | torch (reference)        a decode step: 30 layers, 9 / 3
                                                                              heads, head dim 64, 512 keys

A linear choice reads one batch-1 row through every linear of the model (up to ``MAX_BYTES`` of
weights, in graph order: the weights stream from memory as in a decode step, and no copy of them is
made); each candidate gets a warm-up pass, then ``ROUNDS`` alternated passes (the best kept):
~0.2-0.5 s for SmolLM2. int8 activations are a numerics change (the activations of decode steps
rounded to 8 bits per block of 32), so they are picked only when at least ``INT8_MARGIN`` faster;
an fp32 spelling replaces the C++ kernel only when ``KERNEL_MARGIN`` faster (see there).
Where the C++ kernels are unavailable only the torch spellings are timed.

The cache key holds the CPU (model name and features), the kernels' build, torch's version, the
thread count, this file and, for a linear choice, the shapes timed. A measurement taken while other
processes kept more than ``BUSY_LIMIT`` of the CPUs busy is used but not cached. An entry is read
back only if it is well-formed and its choice is among the candidates and backed by a time;
anything else is measured again (and rewritten).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from ... import cache_dir

logger = logging.getLogger("workbench")

ROUNDS = 3
INT8_MARGIN = 1.10  # int8 activations must measure this much faster than exact to be picked
# Another fp32 spelling must measure this much faster than the C++ kernel to replace it. Linears timed
# back to back flatter BLAS: SmolLM2's fp32 linears on the Xeon of docs/benchmarks.md, AVX-512 build,
# timed here nk 18.2 ms vs kernel 19.6 (nk 8 % faster), while whole decode steps, alternated in
# fresh processes, ran 2-7 % faster on the kernel (3 of 3 pairs).
KERNEL_MARGIN = 1.10
MAX_BYTES = 512 * 2**20  # weights one pass of a linear choice reads at most
CANDIDATES = {
    "fp32 linears": ("kernel", "wxt", "nk"),
    "int4 activations": ("fp32", "int8"),
    "attention": ("cpu", "torch"),
}
_STORE_BYTES = 1 << 20
# A measurement is cached only when other processes kept less than this share of the CPUs busy
# while it ran (``_busy_elsewhere``): one taken beside a test suite or a build would fix a choice for
# an idle machine from a loaded one.
BUSY_LIMIT = 0.25


@dataclass
class Measured:
    """One choice: the candidate taken, the seconds per pass of each candidate timed, and on what."""

    kind: str  # a key of CANDIDATES
    choice: str
    times: Dict[str, float] = field(default_factory=dict)
    workload: str = ""  # what was timed ("121 linears, 513 MiB")
    cached: bool = False  # read from the cache, not measured in this process
    contended: Optional[float] = None  # share of the CPUs other processes used while measured (not cached then)

    def evidence(self) -> str:
        """The candidates' times, fastest first, and on what ("the only candidate here" when one)."""
        if len(self.times) < 2:
            return "the only candidate here"
        ranked = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(self.times.items(), key=lambda kv: kv[1]))
        where = "calibration cached for this CPU" if self.cached else "calibrated on this CPU"
        if self.contended is not None:
            where += f" while other processes used {self.contended:.0%} of it (not cached)"
        return f"{where}, {self.workload}: {ranked}"

    def why(self) -> str:
        return f"{self.choice} ({self.evidence()})"


def _best_of(fns: Dict[str, Callable[[], object]], rounds: int = ROUNDS) -> Dict[str, float]:
    """Seconds per call of each function, best of ``rounds`` alternated calls after a warm-up."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def _kernels() -> bool:
    from . import load

    return load() is None


def _key(kind: str, workload: str) -> str:
    from . import build_dir, isa, loaded_variant

    kernels = _kernels()
    parts: List[str] = [
        kind,
        workload,
        isa.cpu_model(),
        " ".join(sorted(isa.cpu_features())),
        str(loaded_variant()) if kernels else "no kernels",
        build_dir().name if kernels else "",
        torch.__version__,
        str(torch.get_num_threads()),
        hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),  # the workloads and the rules
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _parse(data: bytes, kind: str) -> Optional[Measured]:
    """A cached entry, or None when it is not one this module wrote (junk, edited, other fields)."""
    try:
        raw = json.loads(data)
        m = Measured(kind, raw["choice"], raw["times"], raw["workload"])
    except (ValueError, KeyError, TypeError):
        return None
    valid = (
        raw.get("kind") == kind
        and m.choice in CANDIDATES[kind]
        and isinstance(m.times, dict)
        and all(k in CANDIDATES[kind] and isinstance(v, float) and 0 < v < 60 for k, v in m.times.items())
        and m.choice in m.times
        and isinstance(m.workload, str)
    )
    return m if valid else None


def _cached_or_measured(kind: str, signature: str, measure: Callable[[], Measured]) -> Measured:
    """The cached entry for (``kind``, ``signature``) on this machine, else ``measure()`` written."""
    store = cache_dir.KeyedFiles("calibration", ".json", _STORE_BYTES)
    key = _key(kind, signature)
    data = store.read(key)
    found = _parse(data, kind) if data is not None else None
    if found is not None:
        store.used(key)
        found.cached = True
        return found
    start = time.perf_counter()
    before = _cpu_use()
    m = measure()
    others = _busy_elsewhere(before, _cpu_use())
    logger.info("calibrated %s on this CPU in %.2f s: %s", kind, time.perf_counter() - start, m.why())
    if others is not None and others > BUSY_LIMIT:
        # timings taken while other processes held the CPUs say little about an idle machine: used
        # for this run, not kept (the next run measures again)
        m.contended = others
        logger.info("%s measured while other processes used %.0f%% of the CPUs: not cached", kind, 100 * others)
        return m
    record = {"kind": kind, "choice": m.choice, "times": m.times, "workload": m.workload}
    store.write(key, json.dumps(record, indent=1).encode())
    return m


def _cpu_use() -> Optional[Tuple[float, float, float]]:
    """(wall seconds, busy CPU-seconds of the whole machine, CPU-seconds of this process), or None
    where ``/proc/stat`` is not there (the measurement is then cached as before)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")  # where /proc/stat exists, so does sysconf
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), (sum(fields[:8]) - idle) / hz, usage.ru_utime + usage.ru_stime


def _busy_elsewhere(
    before: Optional[Tuple[float, float, float]], after: Optional[Tuple[float, float, float]]
) -> Optional[float]:
    """The share of all CPUs that other processes kept busy between two ``_cpu_use`` readings."""
    if before is None or after is None:
        return None
    wall = after[0] - before[0]
    if wall <= 0.05:  # too short to say (clock ticks are 10 ms)
        return None
    other = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, other) / (wall * (os.cpu_count() or 1))


T = TypeVar("T")


def _subset(items: Sequence[T], nbytes: Callable[[T], int]) -> List[T]:
    """The first items whose bytes add up to at most MAX_BYTES (at least one)."""
    out: List[T] = []
    total = 0
    for item in items:
        total += nbytes(item)
        if out and total > MAX_BYTES:
            break
        out.append(item)
    return out


def fp32_linear_choice(weights: Sequence[torch.Tensor]) -> Measured:
    """The fastest spelling of a batch-1 fp32 linear on these weights ([N, K] each, in the order a
    step reads them): kernel (where the C++ kernels load), wxt or nk."""
    from ..mlp.cpu_linear_wxt import cpu_linear_wxt

    timed = _subset(weights, lambda w: w.numel() * w.element_size())
    mib = sum(w.numel() * w.element_size() for w in timed) / 2**20
    workload = f"{len(timed)} fp32 linears, {mib:.0f} MiB"
    signature = workload + " " + " ".join(f"{tuple(w.shape)}" for w in timed)

    def measure() -> Measured:
        xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for k in {w.shape[1] for w in timed}}
        fns: Dict[str, Callable[[], object]] = {
            "wxt": lambda: [cpu_linear_wxt(xs[w.shape[1]], w) for w in timed],
            "nk": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in timed],
        }
        if _kernels():
            op = torch.ops.workbench.cpu_linear
            fns["kernel"] = lambda: [op(xs[w.shape[1]], w) for w in timed]
        with torch.no_grad():
            times = _best_of(fns)
        choice = min(times, key=lambda c: times[c])
        if "kernel" in times and times[choice] * KERNEL_MARGIN > times["kernel"]:
            choice = "kernel"
        note = f" (others need {KERNEL_MARGIN:.2f}x the kernel)" if "kernel" in times else ""
        return Measured("fp32 linears", choice, times, workload + note)

    return _cached_or_measured("fp32 linears", signature, measure)


Int4Weights = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # qweight, scales, offsets, group_size


def int4_activation_choice(linears: Sequence[Int4Weights]) -> Measured:
    """Exact fp32 or int8 activations for the int4 kernel on these weights (the C++ kernels must be
    loaded): int8 only when at least INT8_MARGIN faster."""

    def size(w: Int4Weights) -> int:
        return sum(t.numel() * t.element_size() for t in w[:3])

    timed = _subset(linears, size)
    workload = f"{len(timed)} int4 linears, {sum(size(w) for w in timed) / 2**20:.0f} MiB"
    signature = workload + " " + " ".join(f"{tuple(w[0].shape)}/{w[3]}" for w in timed)

    def measure() -> Measured:
        xs = {w[0].shape[1] * 2: torch.randn(1, w[0].shape[1] * 2) for w in timed}
        exact, a8 = torch.ops.workbench.cpu_int4_linear, torch.ops.workbench.cpu_int4_linear_a8
        fns: Dict[str, Callable[[], object]] = {
            "fp32": lambda: [exact(xs[q.shape[1] * 2], q, s, o, g) for q, s, o, g in timed],
            "int8": lambda: [a8(xs[q.shape[1] * 2], q, s, o, g) for q, s, o, g in timed],
        }
        with torch.no_grad():
            times = _best_of(fns)
        choice = "int8" if times["fp32"] >= INT8_MARGIN * times["int8"] else "fp32"
        return Measured("int4 activations", choice, times, f"{workload} (int8 needs {INT8_MARGIN:.2f}x)")

    return _cached_or_measured("int4 activations", signature, measure)


def _attention_workload(kernels: bool) -> Dict[str, Callable[[], object]]:
    from .. import attention  # noqa: F401  (declares torch_cached_attention)

    g = torch.Generator().manual_seed(2)
    hq, hkv, d, keys, page, layers = 9, 3, 64, 512, 16, 30
    pages = keys // page + 1
    caches = [(torch.randn(pages, page, hkv, d, generator=g), torch.randn(pages, page, hkv, d, generator=g))
              for _ in range(layers)]  # fmt: skip
    q, kn, vn = (torch.randn(1, 1, h, d, generator=g) for h in (hq, hkv, hkv))
    meta = (torch.ones(1, dtype=torch.int32), torch.tensor([keys], dtype=torch.int32),
            torch.arange(pages, dtype=torch.int32)[None], 0, d**-0.5)  # fmt: skip
    ops = {"torch": torch.ops.workbench.torch_cached_attention}
    if kernels:
        ops["cpu"] = torch.ops.workbench.cpu_cached_attention

    def run(op: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: [op(q, kn, vn, kc, vc, *meta) for kc, vc in caches]

    return {name: run(op) for name, op in ops.items()}


@functools.lru_cache(maxsize=None)
def _attention(kernels: bool, threads: int) -> Measured:
    workload = "30 layers x 512 keys"

    def measure() -> Measured:
        with torch.no_grad():
            times = _best_of(_attention_workload(kernels))
        return Measured("attention", min(times, key=lambda c: times[c]), times, workload)

    return _cached_or_measured("attention", workload, measure)


def attention_choice() -> Measured:
    """The faster cached attention for decode steps on this CPU (cpu where the kernels load, or torch)."""
    return _attention(_kernels(), torch.get_num_threads())


__all__ = [
    "Measured",
    "attention_choice",
    "fp32_linear_choice",
    "int4_activation_choice",
    "INT8_MARGIN",
    "KERNEL_MARGIN",
]
