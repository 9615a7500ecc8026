"""What ``auto`` picks on a CPU, measured on that CPU: a short calibration once per machine, kernel
build, torch and thread count, cached in ``$WORKBENCH_CACHE_DIR/calibration``.

Which kernel streams a decode step's weights fastest depends on the CPU more than on the model:
MKL's fp32 GEMV reaches well below the copy bandwidth on some CPUs and not on others; the int4
kernel with exact fp32 activations is bound by its instruction count on AVX2 and by memory on
AVX-512, so rounding the activations to int8 (llama.cpp's Q8_1) pays on one and not the other. So
each choice is timed here, on weights streamed from memory as in a decode step:

    choice              candidates                                       workload (batch 1)
    fp32 linears        kernel (cpu_linear) | wxt (MKL, W @ x.T) | nk     12 x [1024, 1024] fp32, 48 MiB
    int4 activations    fp32 (cpu_int4_linear) | int8 (cpu_int4_linear_a8)  32 x [2048, 1024] Q4_1, 36 MiB
    attention           cpu (cpu_cached_attention) | torch (reference)   30 layers, 9 / 3 heads, d 64, 512 keys

Each workload is larger than a core's L2 and alive only while it is timed (a first run's peak memory
rises by the largest, 48 MiB). Each candidate runs a warm-up pass, then ``ROUNDS`` alternated passes
(best kept), ~0.3 s in all. int8 activations are a numerics change (the activations of decode steps rounded to 8 bits per
block of 32), so they are picked only when at least ``INT8_MARGIN`` faster than the exact kernel.
Where the C++ kernels are unavailable only the torch spellings are timed (fp32: wxt | nk).

A cached entry is read back only if it is well-formed and its choices are among the candidates;
anything else is measured again (and rewritten).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ... import cache_dir

logger = logging.getLogger("workbench")

ROUNDS = 3
INT8_MARGIN = 1.10  # int8 activations must measure this much faster than exact to be picked
FP32_CHOICES = ("kernel", "wxt", "nk")
ACT_CHOICES = ("fp32", "int8")
ATTENTION_CHOICES = ("cpu", "torch")
_STORE_BYTES = 1 << 20


@dataclass
class Calibration:
    """The measured choices and the times behind them (seconds per pass over the workload)."""

    fp32_linear: str  # "kernel" | "wxt" | "nk"
    int4_activations: str  # "fp32" | "int8"
    attention: str  # "cpu" | "torch"
    times: Dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # how long the calibration took
    cached: bool = False  # read from the cache, not measured in this process

    def speedup(self, slow: str, fast: str) -> Optional[float]:
        """``times[slow] / times[fast]``, None when either was not measured."""
        a, b = self.times.get(slow), self.times.get(fast)
        return a / b if a and b else None

    def evidence(self, choice: str) -> str:
        """How ``choice`` ("fp32_linear", "int4_activations", "attention") was decided: the
        candidates' times, fastest first, or that there was only one."""
        prefix = {"fp32_linear": "fp32 ", "int4_activations": "int4 ", "attention": "attention "}[choice]
        timed = {k[len(prefix) :]: v for k, v in self.times.items() if k.startswith(prefix)}
        if len(timed) < 2:
            return "the only candidate here"
        ranked = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(timed.items(), key=lambda kv: kv[1]))
        where = "calibration cached for this CPU" if self.cached else "calibrated on this CPU"
        return f"{where}: {ranked}"

    def why(self, choice: str) -> str:
        """``"<value> (<evidence>)"`` for one choice."""
        return f"{getattr(self, choice)} ({self.evidence(choice)})"


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


def _fp32_workload(kernels: bool) -> Dict[str, Callable[[], object]]:
    from ..mlp.cpu_linear_wxt import cpu_linear_wxt

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1024, 1024, generator=g) * 0.02 for _ in range(12)]
    x = torch.randn(1, 1024, generator=g)
    fns: Dict[str, Callable[[], object]] = {
        "fp32 wxt": lambda: [cpu_linear_wxt(x, w) for w in weights],
        "fp32 nk": lambda: [torch.nn.functional.linear(x, w) for w in weights],
    }
    if kernels:
        op = torch.ops.workbench.cpu_linear
        fns["fp32 kernel"] = lambda: [op(x, w) for w in weights]
    return fns


def _int4_workload() -> Dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(1)
    n, k, layers = 2048, 1024, 32
    one = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    codes = [one.clone() for _ in range(layers)]  # distinct memory: streamed, not cache-resident
    scales = [(torch.rand(n, k // 32, generator=g) * 0.02).half() for _ in range(layers)]
    offsets = [((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).half() for _ in range(layers)]
    x = torch.randn(1, k, generator=g)
    exact, a8 = torch.ops.workbench.cpu_int4_linear, torch.ops.workbench.cpu_int4_linear_a8
    return {
        "int4 fp32": lambda: [exact(x, q, s, o, 32) for q, s, o in zip(codes, scales, offsets)],
        "int4 int8": lambda: [a8(x, q, s, o, 32) for q, s, o in zip(codes, scales, offsets)],
    }


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
    ops = {"attention torch": torch.ops.workbench.torch_cached_attention}
    if kernels:
        ops["attention cpu"] = torch.ops.workbench.cpu_cached_attention

    def run(op: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: [op(q, kn, vn, kc, vc, *meta) for kc, vc in caches]

    return {name: run(op) for name, op in ops.items()}


def measure(kernels: bool) -> Calibration:
    """Time every candidate here (``kernels``: the C++ kernels are loaded) and pick."""
    start = time.perf_counter()
    times: Dict[str, float] = {}
    with torch.no_grad():
        times.update(_best_of(_fp32_workload(kernels)))
        if kernels:
            times.update(_best_of(_int4_workload()))
        times.update(_best_of(_attention_workload(kernels)))
    fp32 = min(FP32_CHOICES, key=lambda c: times.get(f"fp32 {c}", float("inf")))
    act = "fp32"
    if kernels and times["int4 fp32"] >= INT8_MARGIN * times["int4 int8"]:
        act = "int8"
    attention = min(ATTENTION_CHOICES, key=lambda c: times.get(f"attention {c}", float("inf")))
    return Calibration(fp32, act, attention, times, time.perf_counter() - start)


def _key(kernels: bool) -> str:
    from . import build_dir, isa, loaded_variant

    parts: List[str] = [
        isa.cpu_model(),
        " ".join(sorted(isa.cpu_features())),
        str(loaded_variant()) if kernels else "no kernels",
        build_dir().name if kernels else "",
        torch.__version__,
        str(torch.get_num_threads()),
        hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),  # the workloads and the rules
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _parse(data: bytes) -> Optional[Calibration]:
    """A cached entry, or None when it is not one this module wrote (junk, edited, other fields)."""
    try:
        raw = json.loads(data)
        cal = Calibration(**{k: raw[k] for k in ("fp32_linear", "int4_activations", "attention", "times", "seconds")})
    except (ValueError, KeyError, TypeError):
        return None
    valid = (
        cal.fp32_linear in FP32_CHOICES
        and cal.int4_activations in ACT_CHOICES
        and cal.attention in ATTENTION_CHOICES
        and isinstance(cal.times, dict)
        and all(isinstance(v, float) and 0 < v < 60 for v in cal.times.values())
        and f"fp32 {cal.fp32_linear}" in cal.times
        and f"attention {cal.attention}" in cal.times
    )
    return cal if valid else None


@functools.lru_cache(maxsize=None)
def _calibration(kernels: bool, threads: int) -> Calibration:
    store = cache_dir.KeyedFiles("calibration", ".json", _STORE_BYTES)
    key = _key(kernels)
    data = store.read(key)
    cached = _parse(data) if data is not None else None
    if cached is not None:
        store.used(key)
        cached.cached = True
        return cached
    cal = measure(kernels)
    logger.info(
        "calibrated the CPU's auto choices in %.2f s: fp32 linears %s, int4 activations %s, attention %s",
        cal.seconds,
        cal.fp32_linear,
        cal.int4_activations,
        cal.attention,
    )
    record = {k: v for k, v in asdict(cal).items() if k != "cached"}
    store.write(key, json.dumps(record, indent=1).encode())
    return cal


def calibration() -> Calibration:
    """This CPU's calibrated ``auto`` choices for the kernels this process loaded (or none), at the
    current thread count: measured once, then read from the cache."""
    from . import load

    return _calibration(load() is None, torch.get_num_threads())


__all__ = ["Calibration", "calibration", "measure", "INT8_MARGIN"]
