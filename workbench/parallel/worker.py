"""One rank of a sharded run: join the group, build the rank's ``Workbench``, serve the parent.

The parent (``launcher.RankGroup``) sends ``(command, args, kwargs)`` over a pipe; the rank answers
with exactly one ``("ok", result, state)`` or ``("error", RankFailure)`` per command, and while a
command runs it streams ``("snapshot", summary)`` for every snapshot it records, so that the parent
has every finished step even when a later one fails or hangs.

The fork server preloads this module and ``workbench.api`` (``launcher.mp_context``): torch and the
whole pipeline are imported once, in the server, instead of once per rank.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from ..errors import InputError
from ..pipeline.context import DistInfo
from .group import GroupSpec, destroy_group, init_group, rank_device
from .summaries import rank_summary


@dataclass(frozen=True)
class RankLaunch:
    """Everything one rank needs to start (picklable: it is the rank process's argument)."""

    rank: int
    group: GroupSpec
    # The class to build (``Workbench`` or a subclass: the one the user called), sent by reference;
    # this package never imports ``workbench.api``: api imports it (to dispatch world_size > 1).
    workbench_class: type
    options: Mapping[str, Any]  # its keyword arguments as the user gave them (validated)
    worker_imports: Tuple[str, ...] = ()
    # The parent's sys.path, working directory and environment at launch: a forkserver child starts
    # from the server's, which were the parent's when the server started (maybe long ago in a notebook).
    sys_path: Tuple[str, ...] = ()
    cwd: Optional[str] = None
    environ: Optional[Mapping[str, str]] = None
    num_threads: int = 1


@dataclass(frozen=True)
class RankFailure:
    """What a rank reports when a command raised (picklable; the parent turns it into ``RankError``)."""

    rank: int
    command: str
    exc_type: str  # qualified name, e.g. "workbench.pipeline.transform_types.TransformError"
    message: str
    traceback: str
    exception: Optional[bytes] = None  # the pickled exception, when it survives a pickle round trip

    @classmethod
    def from_exception(cls, rank: int, command: str, exc: BaseException) -> "RankFailure":
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # exceptions with custom __init__ often pickle but do not unpickle
        except Exception:  # noqa: BLE001 - then only the text travels
            data = None
        return cls(
            rank=rank,
            command=command,
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            exception=data,
        )


def options_for_rank(options: Mapping[str, Any], rank: int, local_rank: int) -> Dict[str, Any]:
    """The rank's own copy of the ``Workbench`` options: its device (``cuda:<local rank>`` when CUDA
    was asked for), and ``debug_visualize_dir`` as given on rank 0, ``<dir>/rank<r>`` on the others
    (their graphs differ once sharded)."""
    out = dict(options)
    out["device"] = rank_device(out.get("device", "auto"), local_rank)
    if out.get("debug_visualize_dir") and rank > 0:
        out["debug_visualize_dir"] = str(Path(out["debug_visualize_dir"]) / f"rank{rank}")
    return out


class WorkerImportError(InputError, ImportError):
    """A ``worker_imports`` module that cannot be imported: bad input (the CLI says it in one line),
    and still an ``ImportError`` for callers that catch that."""


def import_modules(names) -> None:
    """Import the user's modules (``worker_imports``): transforms they register become usable."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise WorkerImportError(
                f"worker_imports: cannot import {name!r} ({e}); give an importable module name "
                "(on sys.path in the parent and in every rank)"
            ) from e


def _no_result(fn: Callable[..., Any]) -> Callable[..., None]:
    def call(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)

    return call


class RankServer:
    """Runs the parent's commands on this rank's ``Workbench``; one reply per command."""

    def __init__(self, wb: Any, conn: Any, rank: int):
        self.wb, self.conn, self.rank = wb, conn, rank
        wb.on_snapshot.append(lambda snap: conn.send(("snapshot", rank_summary(snap))))
        self._commands: Dict[str, Callable[..., Any]] = {
            # Snapshots reach the parent through the hook above, not as results.
            "step": _no_result(self.wb.step),
            "run": _no_result(self.wb.run),
            "run_to": _no_result(self.wb.run_to),
            "rewind": self.wb.rewind,
            "reset": self.wb.reset,
            "enable": self.wb.enable,
            "configure": self.wb.configure,
            "generate": self.generate,
            "render": self.render,
            "render_layer": self.render_layer,
            "report": self.report,
            "plan": self.plan,
            "memory": self.memory,
            "state": lambda: None,
        }

    def state(self) -> Dict[str, Any]:
        err = self.wb.last_error
        return {
            "position": self.wb.position,
            "last_error": None if err is None else str(err),
            "failed_key": None if err is None else err.key,
        }

    def serve(self) -> None:
        while True:
            try:
                command, args, kwargs = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone: nobody to serve
                return
            if command == "close":
                self.conn.send(("ok", None, self.state()))
                return
            try:
                if command not in self._commands:
                    raise ValueError(f"unknown rank command {command!r}")
                result = self._commands[command](*args, **kwargs)
                self.conn.send(("ok", result, self.state()))
            except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
                self.conn.send(("error", RankFailure.from_exception(self.rank, command, e)))

    # ------------------------------------------------------------------ commands with results
    def generate(self, prompts: Any, **kwargs: Any) -> Any:
        """Every rank generates (the graph's collectives need them all); rank 0 returns the whole
        ``GenerationOutput``, the others only their token ids (the parent checks that they agree)."""
        out = self.wb.generate(prompts, **kwargs)
        return out if self.rank == 0 else out.token_ids

    def render(self, key: str, **kwargs: Any) -> str:
        from ..viz.render import render_snapshot

        return render_snapshot(self.wb.snapshot(key), **kwargs).source

    def render_layer(self, key: str, layer: Optional[int] = None, **kwargs: Any) -> str:
        from ..viz.sharding import render_sharded_layer

        return render_sharded_layer(self.wb.snapshot(key), layer, **kwargs).source

    def report(self, out_dir: str, **kwargs: Any) -> str:
        from ..viz.report import write_report

        kwargs.setdefault(
            "title", f"workbench report: {self.wb.loaded.spec} (rank {self.rank} of {self.wb.ctx.dist.world_size})"
        )
        return str(write_report(self.wb, out_dir, **kwargs))

    def plan(self):
        plan = self.wb.ctx.sharding
        return [] if plan is None else list(plan.rows())

    def memory(self) -> Dict[str, Any]:
        return rank_memory(self.wb, self.rank)


def rank_memory(wb: Any, rank: int) -> Dict[str, Any]:
    """Bytes this rank holds: the live graph's tensors, its caches, the eager reference model (kept for
    numerics; shares storage with the graph until weights are sharded or fused), RSS now and at peak."""
    import resource

    import psutil

    from ..pipeline.memory import unique_tensor_bytes

    mod = wb.module
    graph = unique_tensor_bytes([*mod.parameters(), *mod.buffers()])
    eager = unique_tensor_bytes([*wb.loaded.model.parameters(), *wb.loaded.model.buffers()])
    row = {
        "rank": rank,
        "pid": os.getpid(),
        "device": str(wb.ctx.device),
        "position": wb.position,
        "graph_MiB": graph / 2**20,
        "cache_MiB": wb.ctx.cache_bytes() / 2**20,
        "eager_model_MiB": eager / 2**20,
        "rss_MiB": psutil.Process().memory_info().rss / 2**20,
        # ru_maxrss is in KiB on Linux
        "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }
    if wb.ctx.device.type == "cuda":
        row["cuda_allocated_MiB"] = torch.cuda.memory_allocated(wb.ctx.device) / 2**20
        row["cuda_peak_MiB"] = torch.cuda.max_memory_allocated(wb.ctx.device) / 2**20
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def build_rank_workbench(workbench_class: type, options: Mapping[str, Any], dist: DistInfo, local_rank: int) -> Any:
    """The rank's ``Workbench`` (world size 1 in form, ``dist`` in its context)."""
    return workbench_class(**options_for_rank(options, dist.rank, local_rank), dist=dist)


def rank_main(launch: RankLaunch, conn: Any) -> None:
    """The rank process's entry point (the target of ``multiprocessing.Process``)."""
    # Ctrl-C in a terminal reaches the whole process group; the parent decides what happens to ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = [*launch.sys_path, *(p for p in sys.path if p not in launch.sys_path)]
    if launch.environ is not None:
        os.environ.clear()
        os.environ.update(launch.environ)
    if launch.cwd is not None:
        os.chdir(launch.cwd)
    times = {"entered": time.time()}
    command = "start"
    try:
        torch.set_num_threads(launch.num_threads)
        import_modules(launch.worker_imports)
        dist = init_group(launch.rank, launch.group, rank_device(launch.options.get("device", "cpu"), launch.rank))
        times["group_ready"] = time.time()
        wb = build_rank_workbench(launch.workbench_class, launch.options, dist, local_rank=launch.rank)
        times["workbench_ready"] = time.time()
        server = RankServer(wb, conn, launch.rank)
        conn.send(("ok", ready_facts(wb, launch, times), server.state()))
        command = "serve"
        server.serve()
    except BaseException as e:  # noqa: BLE001 - reported, then the rank ends
        try:
            conn.send(("error", RankFailure.from_exception(launch.rank, command, e)))
        except (OSError, EOFError):
            pass
    finally:
        try:
            destroy_group()
        except Exception:  # noqa: BLE001 - the group may be broken by a failed peer; we exit anyway
            pass
        conn.close()


def ready_facts(wb: Any, launch: RankLaunch, times: Dict[str, float]) -> Dict[str, Any]:
    """What the parent learns when a rank is up: the model, the pipeline's keys, start-up times."""
    return {
        "pid": os.getpid(),
        "rank": launch.rank,
        "keys": list(wb.keys),
        "model": repr(wb.loaded),
        "spec": wb.loaded.spec,
        "vocab_size": wb.ctx.vocab_size,
        "has_tokenizer": wb.loaded.tokenizer is not None,
        "device": str(wb.ctx.device),
        "num_threads": torch.get_num_threads(),
        "group_name": wb.ctx.dist.group_name,
        "backend": wb.ctx.dist.backend,
        "times": dict(times),
    }


__all__ = [
    "RankLaunch",
    "RankFailure",
    "RankServer",
    "rank_main",
    "options_for_rank",
    "build_rank_workbench",
    "import_modules",
    "rank_memory",
    "ready_facts",
]
