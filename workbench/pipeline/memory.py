"""Memory accounting for snapshots: what a transform allocated or freed.

On a GPU the CUDA allocator's numbers are the truth. On CPU we count what we own exactly
(parameter, buffer and cache bytes, each storage once, so tied embeddings are not double counted)
and report process RSS alongside as a coarse, noisy figure that is never used for warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import psutil
import torch

# CUDA allocations below this are allocator noise, not a transform's doing.
CUDA_TOLERANCE_BYTES = 1 << 20
# A transform that allocates for a reason only known at run time (e.g. compile_model capturing CUDA
# graphs) says so in TransformInfo.details[EXPECTED_MEM_CHANGE]; the stepper then does not warn.
EXPECTED_MEM_CHANGE = "expected_mem_change"


def unique_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


@dataclass(frozen=True)
class MemoryStats:
    param_bytes: int
    buffer_bytes: int
    cache_bytes: int
    rss_bytes: int
    cuda_allocated: Optional[int] = None
    cuda_reserved: Optional[int] = None
    cuda_free: Optional[int] = None

    @property
    def tracked_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes + self.cache_bytes


def measure(mod: torch.nn.Module, cache_bytes: int, device: torch.device) -> MemoryStats:
    cuda = {}
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        cuda = dict(
            cuda_allocated=torch.cuda.memory_allocated(device),
            cuda_reserved=torch.cuda.memory_reserved(device),
            cuda_free=free,
        )
    return MemoryStats(
        param_bytes=unique_tensor_bytes(mod.parameters()),
        buffer_bytes=unique_tensor_bytes(mod.buffers()),
        cache_bytes=cache_bytes,
        rss_bytes=psutil.Process().memory_info().rss,
        **cuda,
    )


def unexpected_change(before: MemoryStats, after: MemoryStats) -> Optional[str]:
    """A human-readable reason if memory moved in a way nobody declared, else None.

    What we own is exact: parameter, buffer and cache bytes must not change unless the transform
    says so. On a GPU the allocator also sees what we do not track (activations kept alive, a
    library's workspace, a CUDA-graph pool); only *growth* of that beyond 1 MiB is flagged --
    untracked memory going down is temporaries of an earlier step being released (the probe's,
    a tracing pass's), which is what a caching allocator does.
    """
    tracked = after.tracked_bytes - before.tracked_bytes
    if tracked:
        return (
            f"parameter+buffer+cache bytes changed by {tracked / 2**20:+.2f} MiB "
            f"(params {after.param_bytes - before.param_bytes:+d} B, "
            f"buffers {after.buffer_bytes - before.buffer_bytes:+d} B, "
            f"cache {after.cache_bytes - before.cache_bytes:+d} B)"
        )
    if before.cuda_allocated is not None and after.cuda_allocated is not None:
        untracked = after.cuda_allocated - before.cuda_allocated
        if untracked > CUDA_TOLERANCE_BYTES:
            return f"CUDA allocated memory outside parameters/buffers/caches grew by {untracked / 2**20:+.1f} MiB"
    return None
