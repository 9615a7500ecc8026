"""Process-group set-up and tear-down for the ranks of a sharded run.

Two ways in, one way out:

* ranks the workbench starts itself (``Workbench(world_size=N)``, ``workbench run --world-size N``)
  rendezvous through a ``file://`` store in a fresh temporary directory: localhost only, no port to
  pick, nothing left behind for the next run to trip over (the parent deletes the directory);
* ranks ``torchrun`` starts read ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` /
  ``MASTER_PORT`` from the environment (``env://``).

Either way the group gets an explicit collective timeout (``dist_timeout_s``): a rank that died or
raised leaves the others blocked in a collective, and the timeout is what turns that into an error
instead of a hang (the parent also kills them, see ``launcher``). Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from ..errors import InputError
from ..pipeline.context import DistInfo

DEFAULT_DIST_TIMEOUT_S = 300.0
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class GroupSpec:
    """How every rank of one run joins the same process group (picklable: it travels to the ranks)."""

    world_size: int
    init_method: str  # "file:///tmp/.../store" or "env://"
    backend: str  # "gloo" | "nccl"
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S

    def __post_init__(self):
        check_world_size(self.world_size)
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        check_dist_timeout(self.timeout_s)


def check_world_size(world_size: object, name: str = "world_size") -> int:
    """The one check of a world size, for the API (``world_size``) and the CLI (``--world-size``)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"{name} must be a whole number of ranks >= 1, got {world_size!r}; 1 runs in this process")
    return world_size


def check_dist_timeout(seconds: object, name: str = "dist_timeout_s") -> float:
    """The one check of a collective timeout: a positive, finite number of seconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise InputError(
            f"{name} must be a positive number of seconds, got {seconds!r}; it is how long a rank waits for its "
            "peers in a collective before failing (default 300)"
        )
    return float(seconds)


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """torch threads for one rank: the machine's cores shared evenly by the ranks running on it."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_this_machine))


def _device(device: Union[str, torch.device]) -> torch.device:
    from ..models.devices import resolve_device  # "auto" included

    return resolve_device(device)


def backend_for(device: Union[str, torch.device]) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if _device(device).type == "cuda" else "gloo"


def rank_device(device: Union[str, torch.device], local_rank: int) -> torch.device:
    """The device one rank computes on: ``cuda:<local rank>`` when the user asked for CUDA (any
    index: every rank takes its own GPU), the asked device otherwise."""
    device = _device(device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def check_devices(device: Union[str, torch.device], world_size: int) -> None:
    """Fail before any rank starts when the machine cannot give every rank its device."""
    device = _device(device)
    if device.type != "cuda":
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world_size:
        raise ValueError(
            f"world_size={world_size} on CUDA needs one GPU per rank, and this machine has {have}: "
            f"use world_size <= {have}, or device='cpu' (gloo)"
        )


class FileRendezvous:
    """A fresh ``file://`` store for one run: a new temporary directory holding a not-yet-existing
    file (a store file left from an earlier run would make the ranks rendezvous with its stale state).
    ``cleanup()`` removes the directory; it is safe to call more than once."""

    def __init__(self):
        self.directory = Path(tempfile.mkdtemp(prefix="workbench-dist-"))
        self.path = self.directory / "store"

    @property
    def init_method(self) -> str:
        return self.path.as_uri()

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def init_group(rank: int, spec: GroupSpec, device: Optional[Union[str, torch.device]] = None) -> DistInfo:
    """Join the process group as ``rank``; returns the ``DistInfo`` the pipeline context carries.

    ``device``: the rank's device; with NCCL it becomes the current CUDA device first, so that the
    communicator and every collective use this rank's GPU and not GPU 0."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: a sharded run needs it")
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process: a rank "
            "joins exactly one group (call torch.distributed.destroy_process_group() first)"
        )
    if spec.backend == "gloo" and not dist.is_gloo_available():
        raise RuntimeError("torch.distributed was built without gloo: a CPU sharded run needs it")
    if spec.backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("torch.distributed was built without NCCL: run on CPU (gloo) or use a CUDA build")
    if spec.backend == "nccl" and device is not None:
        torch.cuda.set_device(torch.device(device))
    kwargs: Dict[str, Any] = {}
    if spec.init_method != "env://":  # env:// reads rank and world size from the environment
        kwargs = dict(rank=rank, world_size=spec.world_size)
    dist.init_process_group(
        backend=spec.backend, init_method=spec.init_method, timeout=datetime.timedelta(seconds=spec.timeout_s), **kwargs
    )
    assert dist.group.WORLD is not None  # initialised above
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group_name=dist.group.WORLD.group_name,
        backend=spec.backend,
    )


def destroy_group() -> None:
    """Leave the process group if this process is in one (a rank shutting down; idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_env(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int, int]]:
    """``(rank, world_size, local_rank)`` when this process was started by ``torchrun`` (or anything
    that sets the same variables), else None. A partial set is an error: it means a broken launcher."""
    environ = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_ENV if k in environ]
    if not present:
        return None
    if len(present) != len(TORCHRUN_ENV):
        missing = [k for k in TORCHRUN_ENV if k not in environ]
        raise RuntimeError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: "
            "start the ranks with torchrun, which sets all of them"
        )
    try:
        rank, world_size, local_rank = (int(environ[k]) for k in TORCHRUN_ENV)
    except ValueError:
        raise RuntimeError(
            f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got {[environ[k] for k in TORCHRUN_ENV]}"
        ) from None
    return rank, world_size, local_rank


__all__ = [
    "threads_per_rank",
    "check_world_size",
    "check_dist_timeout",
    "GroupSpec",
    "FileRendezvous",
    "DEFAULT_DIST_TIMEOUT_S",
    "backend_for",
    "rank_device",
    "check_devices",
    "init_group",
    "destroy_group",
    "torchrun_env",
]
