"""The step-through driver: run the pipeline one transform at a time, snapshot after each.

State is a cursor into the ordered pipeline plus one snapshot per executed position. Changing or
toggling a transform drops the snapshots from that position on; the next run resumes from the last
valid snapshot (a fresh graph copy sharing parameter storage), so nothing before it re-runs and the
model is not re-exported. A failing transform leaves every earlier snapshot and the live graph as
they were; so does a transform whose graph the numerics probe cannot run (``ProbeError``): a step
is "done" only with a probe that ran, or with the probe off.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from pydantic import ValidationError

from ..models.export_contract import CausalLMLogits, ProbeBatch, make_batch
from . import transforms as _transforms  # noqa: F401  (registers every transform)
from .config import ConfigError, PipelineEntry, resolve_pipeline
from .context import DistInfo, PipelineContext, RuntimeLimits
from .graph.copy import GraphCopy
from .graph.utils import graph_modules, num_nodes, op_histogram
from .interface import TRANSFORMS, GraphState, Stages, TransformError, TransformInfo, TransformRegistry, check_order
from .memory import EXPECTED_MEM_CHANGE, measure, unexpected_change
from .probe_cache import NodeTexts, ProbeCache
from .snapshot import PROVENANCE_KEY, Snapshot, snapshot_of, transform_index
from .stepper_numerics import StepperNumerics
from .weights import WeightSource

logger = logging.getLogger("workbench.pipeline")

NUMERICS_DEFAULT_MAX_PARAMS = 1_000_000_000
SnapshotHook = Callable[[Snapshot], None]


class PipelineStepper(StepperNumerics):
    """Runs an ordered list of transforms over a model with snapshots, rewind and bisect.

    ``loaded`` is a ``workbench.models.LoadedModel``. ``numerics`` defaults to on for models under
    ~1B parameters (one probe forward per transform; ``StepperNumerics`` runs and checks it).
    """

    def __init__(
        self,
        loaded: Any,
        *,
        yaml_extra: Sequence[Union[str, Mapping[str, Any]]] = (),
        overrides: Union[Mapping[str, Any], Iterable[str]] = (),
        entries: Optional[List[PipelineEntry]] = None,
        device: Union[str, torch.device] = "cpu",
        max_batch_size: int = 64,
        max_seq_len: Optional[int] = None,
        max_num_tokens: Optional[int] = None,
        page_size: int = 16,
        numerics: Optional[bool] = None,
        snapshots: bool = True,
        probe_shape: Tuple[int, int] = (2, 16),
        on_snapshot: Sequence[SnapshotHook] = (),
        registry: TransformRegistry = TRANSFORMS,
        dist: Optional[DistInfo] = None,
        probe_cache: bool = False,
        export_cache: bool = False,
    ):
        """``dist``: this process's rank in a sharded run (``workbench.parallel`` makes it); None:
        world size 1. ``probe_cache``: reuse numerics probe results an earlier process computed for
        the same graph, weights, configs and code (``pipeline.probe_cache``; ``workbench run`` turns
        it on). ``export_cache``: read the exported graph an earlier process exported for the same
        model, config and code (``transforms/export/export_cache.py``; ``workbench run`` turns it on)."""
        self.loaded = loaded
        self.registry = registry
        self.entries: List[PipelineEntry] = (
            list(entries) if entries is not None else resolve_pipeline(yaml_extra, overrides, registry=registry)
        )
        self._check_unique()
        device = torch.device(device)
        max_pos = getattr(loaded.config, "max_position_embeddings", 2048) or 2048
        dtype = next(loaded.model.parameters()).dtype
        # The one source of the runtime limits; transforms read (and, where a field overrides one,
        # write) ctx.limits, generate reads the cache built from it.
        self.limits = RuntimeLimits(
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len if max_seq_len is not None else min(int(max_pos), 4096),
            max_num_tokens=max_num_tokens,
            page_size=page_size,
        )
        self.ctx = PipelineContext(
            spec=loaded.spec, loaded=loaded, device=device, dtype=dtype, limits=self.limits, dist=dist or DistInfo()
        )
        self.record_graphs = snapshots
        if numerics is None:
            numerics = loaded.num_parameters < NUMERICS_DEFAULT_MAX_PARAMS
        self.numerics_enabled = numerics
        self.probe: ProbeBatch = make_batch(self.ctx.vocab_size, *probe_shape, seed=1234, device=device)
        self.on_snapshot: List[SnapshotHook] = list(on_snapshot)
        self._eager = CausalLMLogits(loaded.model).eval()
        # What load_weights binds the meta-traced graph to: the eager model's own tensors by name.
        self.ctx.weights = WeightSource(self._eager)
        self._reference: Optional[torch.Tensor] = None
        self.snapshots: List[Snapshot] = []
        self._probed: Optional[tuple] = None  # (module, probe function) the last probe ran on
        self.probe_cache: Optional[ProbeCache] = ProbeCache() if probe_cache else None
        if export_cache:
            from .transforms.export.export_cache import ExportCache

            self.ctx.export_cache = ExportCache()
        self._probe_run_key: Optional[str] = None
        self._node_texts: NodeTexts = {}  # graph_structure's memo: each node formatted once
        self.last_error: Optional[TransformError] = None
        # Snapshots off (no graph copies): the graph before a skip_on_error step, and whether the
        # live graph is lost (a failed or rewound step) so the next step starts from the export.
        self._checkpoint: Optional[GraphCopy] = None
        self._rerun_from_start = False
        self._live: torch.nn.Module = self._eager
        self._state = GraphState()

    # ------------------------------------------------------------------ pipeline inspection
    @property
    def keys(self) -> List[str]:
        return [e.key for e in self.entries]

    @property
    def position(self) -> int:
        """Index of the next transform to run (== number of valid snapshots)."""
        return len(self.snapshots)

    @property
    def done(self) -> bool:
        return self.position >= len(self.entries)

    @property
    def module(self) -> torch.nn.Module:
        """The live module after the last executed transform."""
        return self._live

    def index(self, key: str) -> int:
        return transform_index(self.keys, key)

    def snapshot(self, key: str) -> Snapshot:
        return snapshot_of(self.keys, self.snapshots, key)

    def status(self, key: str) -> str:
        """pending / done / skipped / failed for one transform."""
        i = self.index(key)
        if i < len(self.snapshots):
            return self.snapshots[i].status
        if self.last_error is not None and self.last_error.key == key and i == self.position:
            return "failed"
        return "pending"

    # ------------------------------------------------------------------ editing
    def enable(self, key: str, enabled: bool = True) -> None:
        self.configure(key, enabled=enabled)

    def configure(self, key: str, **fields: Any) -> None:
        """Change fields of one transform (validated) and invalidate it and what follows."""
        i = self.index(key)
        entry = self.entries[i]
        cls = self.registry.get(key).config_class
        try:
            new_cfg = cls.model_validate({**entry.config.model_dump(), **fields})
        except Exception as e:  # pydantic ValidationError -> our message format
            from .config import _format_validation

            raise ConfigError(_format_validation(key, cast(ValidationError, e), cls, "configure()")) from None
        if new_cfg.stage != entry.config.stage:
            raise ConfigError(f"transform '{key}': changing the stage is not supported here")
        if new_cfg == entry.config:
            return
        order = check_order([*self.entries[:i], PipelineEntry(key, new_cfg), *self.entries[i + 1 :]], self.registry)
        if order:
            raise ConfigError(order)
        self.entries[i] = PipelineEntry(key, new_cfg)
        self.invalidate(i)

    def invalidate(self, index: int) -> None:
        """Drop snapshots at ``index`` and later; the live graph returns to the one before."""
        if index >= len(self.snapshots):
            if self.last_error is not None and self.index(self.last_error.key) >= index:
                self.last_error = None
            return
        del self.snapshots[index:]
        self.last_error = None
        self._restore_live()

    def rewind(self, key: str) -> None:
        """Go back so that ``key`` is the next transform to run."""
        self.invalidate(self.index(key))

    def reset(self) -> None:
        """Back to the eager model (the next step re-exports)."""
        self.invalidate(0)

    def _restore_live(self) -> None:
        if self._checkpoint is not None:  # snapshots off, skip_on_error: the copy taken before the step
            self._live, self._checkpoint = self._checkpoint.materialize(), None
            return
        if self.snapshots and self.snapshots[-1].graph_copy is None:
            # Graph copies were not kept (snapshots=False): the finished steps keep their rows (the
            # table, status()), and the next step repeats them from the export first.
            self._rerun_from_start = True
            return
        if self.snapshots:
            last = self.snapshots[-1]
            assert last.graph_copy is not None  # cleared above otherwise
            self._live = last.graph_copy.materialize()
            self.ctx.restore(last.context, self.limits)
            self._state = GraphState(last.info.is_clean, last.info.has_valid_shapes)
        else:
            self._live = self._eager
            self.ctx.restore(None, self.limits)
            self._state = GraphState()

    def _start_over(self) -> None:
        """Snapshots off and the live graph lost: drop the finished steps' rows and start from the
        eager model (the export cache, where on, makes the export quick)."""
        logger.info("snapshots are off: repeating the %d finished steps from the export", len(self.snapshots))
        self.snapshots.clear()
        self._rerun_from_start = False
        self._live = self._eager
        self.ctx.restore(None, self.limits)
        self._state = GraphState()

    def _check_unique(self) -> None:
        seen = set()
        for e in self.entries:
            if e.key in seen:
                raise ConfigError(f"transform '{e.key}' appears twice in the pipeline")
            seen.add(e.key)
        order = check_order(self.entries, self.registry)
        if order:
            raise ConfigError(order)

    # ------------------------------------------------------------------ running
    def step(self) -> Snapshot:
        """Run the next transform and record its snapshot."""
        if self.done:
            raise StopIteration("the pipeline has run to the end; rewind() or reset() to re-run")
        if self._rerun_from_start:
            self._start_over()
        i = self.position
        entry = self.entries[i]
        transform = self.registry.get(entry.key)(entry.config)
        if entry.config.skip_on_error and not self.record_graphs and graph_modules(self._live):
            # No snapshot to go back to if it fails: one copy of the graph before it (shares the weights).
            self._checkpoint = GraphCopy(self._live)
        prev_names = self.snapshots[-1].node_names if self.snapshots else frozenset()
        # Before the first transform there is no graph yet: it starts from zero bytes (the eager
        # model's tensors are the reference's, not the pipeline's).
        live = self._live if self._live is not self._eager else torch.nn.Module()
        mem_before = measure(live, self.ctx.cache_bytes(), self.ctx.device)
        state = GraphState(self._state.is_clean, self._state.has_valid_shapes)
        try:
            mod, info, times = transform(self._live, self.ctx, state)
        except TransformError as e:
            self.last_error = e
            self._restore_live()  # the failing transform may have half-rewritten the live graph
            raise
        if info.skipped and (info.skip_reason or "").startswith("error"):
            self._restore_live()  # skip_on_error: undo whatever the failing call changed
            mod, state = self._live, GraphState(self._state.is_clean, self._state.has_valid_shapes)
        self.last_error = None
        self._live, self._state = mod, state
        snap = self._record(i, entry, info, times, mem_before, prev_names)
        if snap.numerics is not None and not snap.numerics.ok:
            # the probe could not run on the graph this transform left: nothing later can be trusted on it
            snap = self._step_failed(i, entry, snap, mem_before, prev_names, self._probe_error(snap))
        else:
            moved = self._moved_answer(entry, transform, snap)
            if moved is not None:
                snap = self._step_failed(i, entry, snap, mem_before, prev_names, moved)
        self._checkpoint = None  # the step stands, or was undone from it already
        self.snapshots.append(snap)
        for hook in self.on_snapshot:
            hook(snap)
        return snap

    def _record(self, i, entry, info, times, mem_before, prev_names) -> Snapshot:
        mod = self._live
        added: List[str] = []
        names = set()
        for gm in graph_modules(mod):
            for node in gm.graph.nodes:
                names.add(node.name)
                if PROVENANCE_KEY not in node.meta:
                    node.meta[PROVENANCE_KEY] = entry.key
                    added.append(node.name)
        removed = sorted(prev_names - names) if prev_names else []
        mem_after = measure(mod, self.ctx.cache_bytes(), self.ctx.device)
        warning = None
        declared = entry.config.expect_mem_change or info.details.get(EXPECTED_MEM_CHANGE)
        if not declared and not info.skipped:
            warning = unexpected_change(mem_before, mem_after)
            if warning:
                logger.warning(
                    "[stage=%s, transform=%s] unexpected memory change: %s",
                    entry.config.stage.value,
                    entry.key,
                    warning,
                )
        changed = bool(added or removed) or info.num_matches > 0 or not self.snapshots
        if not self.record_graphs or not graph_modules(mod):
            stored = None
        elif changed:
            stored = GraphCopy(mod)
        else:  # nothing changed: share the previous snapshot's (immutable) copy
            stored = self.snapshots[-1].graph_copy
        return Snapshot(
            index=i,
            key=entry.key,
            stage=entry.config.stage,
            config=entry.config,
            info=info,
            times=times,
            mem_before=mem_before,
            mem_after=mem_after,
            mem_warning=warning,
            num_nodes=num_nodes(mod),
            op_histogram=op_histogram(mod),
            graph_copy=stored,
            node_names=frozenset(names),
            added_nodes=added,
            removed_nodes=removed,
            numerics=self._numerics(mod, changed, i) if self.numerics_enabled else None,
            context=self.ctx.state(),
        )

    def _step_failed(self, i, entry, snap: Snapshot, mem_before, prev_names, cause: Exception) -> Snapshot:
        """Fail the step that left ``snap`` with ``cause`` (never "done"): the live graph returns to
        the previous snapshot's. With ``skip_on_error`` the transform is undone and recorded as
        failed, as for any error."""
        self._probed = None
        self._restore_live()
        if not entry.config.skip_on_error:
            self.last_error = TransformError(entry.key, entry.config.stage, cause)
            raise self.last_error
        logger.warning("[stage=%s, transform=%s] skipped on error: %s", entry.config.stage.value, entry.key, cause)
        info = TransformInfo(
            skipped=True,
            skip_reason=f"error: {type(cause).__name__}: {cause}",
            is_clean=self._state.is_clean,
            has_valid_shapes=self._state.has_valid_shapes,
        )
        return self._record(i, entry, info, snap.times, mem_before, prev_names)

    def run_to(self, key: str) -> List[Snapshot]:
        """Run up to and including ``key``."""
        target = self.index(key)
        out = []
        while self.position <= target:
            out.append(self.step())
        return out

    def run(self) -> List[Snapshot]:
        out = []
        while not self.done:
            out.append(self.step())
        return out

    # ------------------------------------------------------------------ analysis
    def table(self):
        """The per-transform table as a pandas DataFrame."""
        import pandas as pd

        rows, prev = [], 0
        for s in self.snapshots:
            rows.append(s.row(prev))
            prev = s.num_nodes
        return pd.DataFrame(rows)

    def total_time(self) -> float:
        return sum(s.times.total for s in self.snapshots)


__all__ = ["PipelineStepper", "Stages", "TransformError", "ConfigError"]
