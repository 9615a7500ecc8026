"""``ShardedWorkbench``: what ``Workbench(model, world_size=N)`` returns.

The user holds this object in the parent process; the pipeline runs in N rank processes (each a
``Workbench`` with ``ctx.dist`` set, see ``worker``), in lockstep, because a sharded graph's
collectives need every rank. The parent never joins the process group, so re-creating one in a
notebook cell is safe; what it keeps is the merged per-rank snapshot summaries, which stay readable
after the ranks are gone.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type, Union

from ..answer import answer, backends_line
from ..pipeline.snapshot import snapshot_of, transform_index
from ..runtime.generate import DEFAULT_PROMPT
from .group import (
    DEFAULT_DIST_TIMEOUT_S,
    FileRendezvous,
    GroupSpec,
    backend_for,
    check_devices,
    check_dist_timeout,
    check_world_size,
    threads_per_rank,
)
from .launcher import RankError, RankGroup, mp_context
from .summaries import ShardedSnapshot, SnapshotMerger, sharded_table
from .worker import RankLaunch, import_modules

logger = logging.getLogger("workbench.parallel")

# Options that cannot cross into the ranks, and why.
_REFUSED = {
    "dist": "the ranks' DistInfo is made by the launcher (leave `dist` out)",
    "on_snapshot": "snapshot hooks would run in the rank processes; read ShardedWorkbench.snapshots instead",
}
# ShardedWorkbench's own options: they shape the launch, the ranks never see them.
_LAUNCH_OPTIONS = ("world_size", "dist_timeout_s", "worker_imports", "start_method")


def workbench_option_names(workbench_class: Type[Any]) -> set:
    """Every keyword ``workbench_class(...)`` takes and hands to a rank (its own and the stepper's)."""
    from ..pipeline.stepper import PipelineStepper

    own = set(inspect.signature(workbench_class.__init__).parameters)
    stepper = set(inspect.signature(PipelineStepper.__init__).parameters)
    return (own | stepper) - {"self", "kwargs", "loaded"} - set(_LAUNCH_OPTIONS)


def validate_options(
    workbench_class: type, model: Any, options: Mapping[str, Any], world_size: int = 1
) -> Dict[str, Any]:
    """Check in the parent, in milliseconds, what would otherwise fail in every rank after a model load:
    unknown options, the device, the pipeline (``yaml_extra`` / ``overrides`` typos). Returns the
    options the ranks get (``model`` as a spec string, paths made absolute). An unwritable
    ``debug_visualize_dir`` is reported by the ranks as they start (``Workbench`` checks it there)."""
    from ..models import LoadedModel
    from ..models.devices import AUTO, auto_device, resolve_device
    from ..pipeline.config import resolve_pipeline, yaml_extra_list
    from ..pipeline.interface import TRANSFORMS

    refused = sorted(set(options) & set(_REFUSED))
    if refused:
        raise ValueError(f"Workbench(world_size>1) cannot take {refused[0]!r}: {_REFUSED[refused[0]]}")
    known = workbench_option_names(workbench_class)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{workbench_class.__name__}: unknown option(s) {unknown}; known: {sorted(known)}")
    out = dict(options)
    if isinstance(model, LoadedModel):
        # A loaded model's weights stay in this process; every rank loads its own from the spec.
        logger.info("world_size>1: each rank loads %s from its spec (the LoadedModel passed is not sent)", model.spec)
        model = model.spec
    out["model"] = model
    device = out.get("device", AUTO)
    # "auto" for N ranks: CUDA only when every rank gets a GPU of its own
    out["device"] = str(auto_device(world_size) if str(device).strip().lower() == AUTO else resolve_device(device))
    # A one-shot iterable of overrides is read once here; the ranks get the same list.
    if "overrides" in out and not isinstance(out["overrides"], Mapping):
        overrides = out["overrides"]
        out["overrides"] = [overrides] if isinstance(overrides, str) else list(overrides)
    if "yaml_extra" in out:  # one path or mapping is a list of one, as in a single-process Workbench
        out["yaml_extra"] = [
            str(Path(y).resolve()) if isinstance(y, (str, os.PathLike)) else y
            for y in yaml_extra_list(out["yaml_extra"])
        ]
    if not out.get("entries"):
        resolve_pipeline(out.get("yaml_extra", ()), out.get("overrides", ()), out.get("registry", TRANSFORMS))
    if out.get("debug_visualize_dir"):
        out["debug_visualize_dir"] = str(Path(out["debug_visualize_dir"]).resolve())
    return out


class ShardedWorkbench:
    """Step through the compilation pipeline of one model on N ranks.

    >>> with Workbench("tiny:llama", world_size=2) as wb:   # 2 CPU ranks, gloo
    ...     wb.run(); wb.table(); wb.plan()
    ...     wb.generate(["Hello"], max_new_tokens=8).texts

    Takes every ``Workbench`` option (sent to each rank) plus ``world_size``, ``dist_timeout_s`` (the
    collective timeout: how long a rank waits for a peer before it gives up), ``worker_imports``
    (modules imported in the parent and every rank first: user transforms register there) and
    ``start_method`` ("forkserver" by default, or "spawn"). Any rank failing brings every rank down
    with that rank's error (``RankError``); the snapshots received until then stay readable.
    """

    def __init__(
        self,
        model: Any = "smollm2",
        *,
        world_size: int,
        workbench_class: type,
        dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
        worker_imports: Sequence[str] = (),
        start_method: Optional[str] = None,
        **options: Any,
    ):
        """``workbench_class``: what each rank builds (``Workbench.__new__`` passes the class it was
        called on); create sharded runs with ``Workbench(..., world_size=N)``."""
        check_world_size(world_size)
        dist_timeout_s = check_dist_timeout(dist_timeout_s)
        self.world_size = world_size
        self.workbench_class = workbench_class
        self.worker_imports = tuple([worker_imports] if isinstance(worker_imports, str) else worker_imports)
        import_modules(self.worker_imports)  # before validation: their transforms are in the pipeline
        self.options = validate_options(workbench_class, model, options, world_size)
        check_devices(self.options["device"], world_size)
        start_method = mp_context(start_method).get_start_method()  # an unknown method fails here
        # Checked now (a bad timeout), given its rendezvous below: nothing is made before the check.
        group = GroupSpec(world_size, "env://", backend_for(self.options["device"]), float(dist_timeout_s))
        self._snapshots: List[ShardedSnapshot] = []
        self._merger = SnapshotMerger(world_size)
        self.last_error: Optional[str] = None
        rendezvous = FileRendezvous()  # RankGroup's finalizer removes it
        group = dataclasses.replace(group, init_method=rendezvous.init_method)
        threads = threads_per_rank(world_size)
        launches = [
            RankLaunch(
                rank=r,
                group=group,
                workbench_class=workbench_class,
                options=self.options,
                worker_imports=self.worker_imports,
                sys_path=tuple(sys.path),
                cwd=os.getcwd(),
                environ=dict(os.environ),
                num_threads=threads,
            )
            for r in range(world_size)
        ]
        t0 = time.perf_counter()
        self._group = RankGroup(launches, rendezvous, start_method)
        replies = self._group.collect(range(world_size), "start")
        self.start_s = time.perf_counter() - t0  # from the first fork to every rank serving
        self.rank_facts: List[Dict[str, Any]] = [replies[r][0] for r in range(world_size)]
        # Fixed for the run: the start method the ranks were made with, and rank 0's start-up facts.
        self.start_method: str = self._group.start_method
        facts = self.rank_facts[0]
        self.keys: List[str] = list(facts["keys"])
        self.model_description: str = facts["model"]
        self.vocab_size: int = facts["vocab_size"]
        self.has_tokenizer: bool = facts["has_tokenizer"]

    # ------------------------------------------------------------------ the ranks' state (changes)
    @property
    def pids(self) -> List[int]:
        """The rank processes' ids (rank order)."""
        return self._group.pids

    @property
    def closed(self) -> bool:
        return self._group.closed

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that brought the ranks down (None while they run)."""
        return self._group.failure

    def __repr__(self) -> str:
        state = (
            f"closed after {str(self.failure).splitlines()[0]}"
            if self.failure
            else ("closed" if self.closed else f"{self.position}/{len(self.keys)} transforms run")
        )
        return f"ShardedWorkbench({self.options['model']!r}, world_size={self.world_size}, {state})"

    # ------------------------------------------------------------------ snapshots (parent side)
    @property
    def snapshots(self) -> List[ShardedSnapshot]:
        """One merged snapshot per executed transform (rank 0's face, every rank's memory and nodes)."""
        return list(self._snapshots)

    @property
    def position(self) -> int:
        return len(self._snapshots)

    @property
    def done(self) -> bool:
        return self.position >= len(self.keys)

    def index(self, key: str) -> int:
        return transform_index(self.keys, key)

    def snapshot(self, key: str) -> ShardedSnapshot:
        return snapshot_of(self.keys, self._snapshots, key)

    def table(self):
        """The per-transform table (pandas): rank 0's usual columns plus ``nodes_r<r>``,
        ``mem_MiB_r<r>`` and ``d_mem_MiB_r<r>`` for every rank."""
        return sharded_table(self._snapshots)

    def total_time(self) -> float:
        return sum(s.times.total for s in self._snapshots)

    def _on_snapshot(self, rank: int, summary: Any) -> None:
        merged = self._merger.add(rank, summary)
        if merged is not None:
            del self._snapshots[merged.index :]
            self._snapshots.append(merged)

    # ------------------------------------------------------------------ lockstep commands
    def _all(self, command: str, *args: Any, **kwargs: Any) -> Dict[int, Any]:
        """Run ``command`` on every rank; results by rank. Keeps the snapshot list in step with the ranks."""
        try:
            replies = self._group.request(range(self.world_size), command, args, kwargs, self._on_snapshot)
        except BaseException as e:
            if isinstance(e.__cause__, RankError) and e.__cause__.recoverable or getattr(e, "recoverable", False):
                self._sync()  # every rank raised alike and is still up: re-read where they stand
            raise
        self._apply_state(replies[0][1])
        return {r: result for r, (result, _state) in replies.items()}

    def _sync(self) -> None:
        replies = self._group.request([0], "state", (), {}, self._on_snapshot)
        self._apply_state(replies[0][1])

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        del self._snapshots[state["position"] :]
        self._merger.clear()
        self.last_error = state["last_error"]

    def step(self) -> ShardedSnapshot:
        """Run the next transform on every rank; returns its merged snapshot."""
        self._all("step")
        return self._snapshots[-1]

    def run(self) -> List[ShardedSnapshot]:
        """Run the rest of the pipeline on every rank; returns the new merged snapshots."""
        start = self.position
        self._all("run")
        return self._snapshots[start:]

    def run_to(self, key: str) -> List[ShardedSnapshot]:
        start = self.position
        self.index(key)  # an unknown key fails here, not in N processes
        self._all("run_to", key)
        return self._snapshots[start:]

    def rewind(self, key: str) -> None:
        self.index(key)
        self._all("rewind", key)

    def reset(self) -> None:
        self._all("reset")

    def enable(self, key: str, enabled: bool = True) -> None:
        self.index(key)
        self._all("enable", key, enabled)

    def configure(self, key: str, **fields: Any) -> None:
        self.index(key)
        self._all("configure", key, **fields)

    def status(self, key: str) -> str:
        i = self.index(key)
        if i < self.position:
            return self._snapshots[i].status
        return "failed" if self.last_error and f"transform={key}]" in self.last_error else "pending"

    def generate(self, prompts: Any, max_new_tokens: int = 64, **kwargs: Any):
        """Generate on every rank (runs the rest of the pipeline first); returns rank 0's
        ``GenerationOutput``. A ``stream`` callback is refused: it would run in the ranks."""
        if kwargs.get("stream") is not None:
            raise ValueError(
                "generate(stream=...) is not available with world_size>1: the callback would run in "
                "the rank processes; use the returned GenerationOutput"
            )
        results = self._all("generate", prompts, max_new_tokens=max_new_tokens, **kwargs)
        out = results[0]
        for r in range(1, self.world_size):
            if results[r] != out.token_ids:
                logger.warning(
                    "rank %d generated other tokens than rank 0 (%s vs %s): the ranks' graphs disagree",
                    r,
                    results[r],
                    out.token_ids,
                )
        return out

    # ------------------------------------------------------------------ one rank's view
    def _one(self, rank: int, command: str, *args: Any, **kwargs: Any) -> Any:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return self._group.request([rank], command, args, kwargs, self._on_snapshot)[rank][0]

    def backends_line(self) -> str:
        """``Workbench.backends_line`` of rank 0, with the ranks' device."""
        return backends_line(self, self._where())

    def _where(self) -> str:
        return f"{self.world_size} ranks on {self.options['device']}"

    def answer(self, prompt: Any = DEFAULT_PROMPT, max_new_tokens: int = 32, **kwargs: Any):
        """``Workbench.answer`` across the ranks: one greedy answer of the sharded compiled model,
        printed with what ran (rank 0's backends) and tokens/s."""
        return answer(self, prompt, max_new_tokens, self._where(), self.has_tokenizer, self.vocab_size, **kwargs)

    def render(self, key: str, rank: int = 0, **kwargs: Any):
        """``workbench.viz.render.render_snapshot`` of ``key``'s snapshot on ``rank``, as a
        ``graphviz.Source`` (displays in a notebook; ``.pipe(format="svg")`` for the SVG)."""
        import graphviz

        self.snapshot(key)  # not run yet: fail here with the usual message
        return graphviz.Source(self._one(rank, "render", key, **kwargs))

    def render_layer(
        self, layer: Optional[int] = None, rank: int = 0, key: str = "sharding_transform_executor", **kwargs: Any
    ):
        """One sharded layer of ``rank``'s graph after ``key`` (``workbench.viz.sharding.
        render_sharded_layer``): its cut nodes labelled with what that rank holds, and the
        collectives. ``layer`` None: the first layer with a split region."""
        import graphviz

        self.snapshot(key)
        return graphviz.Source(self._one(rank, "render_layer", key, layer, **kwargs))

    def report(self, out_dir: Union[str, Path], rank: int = 0, **kwargs: Any) -> Path:
        """``rank`` writes its HTML report (``workbench.viz.report.write_report``) to ``out_dir``."""
        return Path(self._one(rank, "report", str(Path(out_dir).resolve()), **kwargs))

    def plan(self) -> List[Dict[str, Any]]:
        """Rank 0's sharding plan rows (``ctx.sharding.rows()``); empty before or without sharding."""
        return self._one(0, "plan")

    def memory(self):
        """Per-rank memory now (pandas, one row per rank): graph tensors, caches, the eager reference
        model, RSS and peak RSS (and CUDA allocator figures on GPU)."""
        import pandas as pd

        replies = self._group.request(range(self.world_size), "memory", (), {}, self._on_snapshot)
        return pd.DataFrame([replies[r][0] for r in range(self.world_size)])

    def ui(self):
        """The notebook panel steps one process's pipeline; it does not drive ranks yet."""
        raise NotImplementedError(
            "the notebook panel (wb.ui()) drives a one-process Workbench, not the ranks of a sharded run: "
            "use wb.table(), wb.plan(), wb.render_layer(rank=...), wb.memory() here, or Workbench(model).ui() "
            "for the panel on one process"
        )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the ranks (idempotent). Snapshots stay readable."""
        self._group.close()

    def __enter__(self) -> "ShardedWorkbench":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ShardedWorkbench", "validate_options", "workbench_option_names"]
