"""Device profiles for the roofline: peak FLOP/s, bandwidths and a per-launch overhead.

``h100``: NVIDIA H100 SXM5 datasheet numbers -- 989 TFLOP/s dense BF16 tensor-core peak, 3.35 TB/s
HBM3 -- with floating tensors counted as bf16 (2 bytes; the pipeline's default dtype on CUDA). Its
4 us per launch is an assumption (an eager kernel launch from Python, no CUDA graph), not a
datasheet number: set ``launch_s=0`` for a CUDA-graph replay.

``this-cpu``: measured once per process on this machine (``measure_this_cpu``, ~1 s): the
bandwidth of an fp32 GEMV (what a batch-1 decode's linears do), of a large copy (read + write, what
elementwise ops do), the fp32 GEMM rate and the time of one tiny op call through the dispatcher
(the per-node overhead of an eager graph). Tensors count at the graph's own dtypes.

Roofline time of a node: ``max(flops / peak, bytes / bandwidth) + launches * launch_s``, with the
GEMV bandwidth for matmul and quantized-linear nodes and the copy bandwidth for the rest.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

MATMUL_CATEGORIES = ("matmul", "quant", "moe")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # FLOP/s
    gemv_bandwidth: float  # B/s, streaming weights through a matrix-vector product
    copy_bandwidth: float  # B/s, read + write of a large copy
    launch_s: float  # seconds per non-view node
    float_bytes: Optional[int]  # floating tensors counted at this width (None: as in the graph)
    source: str

    def bandwidth(self, category: str) -> float:
        return self.gemv_bandwidth if category in MATMUL_CATEGORIES else self.copy_bandwidth

    def node_time(self, flops: float, nbytes: float, category: str, launches: int) -> float:
        if not launches:
            return 0.0
        return max(flops / self.peak_flops, nbytes / self.bandwidth(category)) + launches * self.launch_s

    def bound(self, flops: float, nbytes: float, category: str, launches: int) -> str:
        """Which term of the roofline sets the node's time: compute, memory or launch."""
        if not launches:
            return "-"
        c, m = flops / self.peak_flops, nbytes / self.bandwidth(category)
        if self.launch_s > max(c, m):
            return "launch"
        return "compute" if c > m else "memory"


H100 = DeviceProfile(
    name="h100",
    peak_flops=989e12,
    gemv_bandwidth=3.35e12,
    copy_bandwidth=3.35e12,
    launch_s=4e-6,
    float_bytes=2,
    source="H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3; 4 us/launch assumed (eager)",
)


def wall_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best of ``repeats`` calls after one warm-up (allocation, first-call dispatch), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Run with ``n`` intra-op threads (None: as set), restored on exit. On a machine shared with
    other jobs, 1 thread times stably: with more, OpenMP workers wait at every op's barrier for a
    descheduled sibling (measured here under load: a tiny-model step 270 ms on 2 threads, 4-9 ms on 1)."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@functools.lru_cache(maxsize=4)
def measure_this_cpu(threads: Optional[int] = None) -> DeviceProfile:
    """Measure this machine once per process and thread count (cached): GEMV and copy bandwidth,
    GEMM rate, the time of one op call."""
    with torch.no_grad(), torch_threads(threads):
        w = torch.randn(4096, 4096)  # 64 MiB fp32: far past the caches
        x = torch.randn(4096)
        gemv = w.nbytes / wall_time(lambda: torch.mv(w, x), 5)
        src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB each
        copy = 2 * src.nbytes / wall_time(lambda: dst.copy_(src), 5)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        peak = 2 * 1024**3 / wall_time(lambda: torch.mm(a, b), 3)
        one = torch.ones(1)
        calls = 200
        launch = wall_time(lambda: [torch.add(one, one) for _ in range(calls)], 3) / calls
        used = torch.get_num_threads()
    return DeviceProfile(
        name="this-cpu",
        peak_flops=peak,
        gemv_bandwidth=gemv,
        copy_bandwidth=copy,
        launch_s=launch,
        float_bytes=None,
        source=(
            f"measured here ({used} thread{'s' if used > 1 else ''}, torch {torch.__version__}): fp32 GEMV "
            f"{gemv / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s, fp32 GEMM {peak / 1e9:.1f} GFLOP/s, "
            f"{launch * 1e6:.1f} us per op call"
        ),
    )


def device_profile(device: "str | DeviceProfile", threads: Optional[int] = None) -> DeviceProfile:
    if isinstance(device, DeviceProfile):
        return device
    if device == "h100":
        return H100
    if device == "this-cpu":
        return measure_this_cpu(threads)
    raise ValueError(f"device {device!r}: expected 'h100', 'this-cpu' or a DeviceProfile")


__all__ = ["DeviceProfile", "H100", "measure_this_cpu", "device_profile", "torch_threads"]
