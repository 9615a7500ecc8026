"""The stepper's numerics: graphs run on inputs, each step's probe against the eager model, bisect.

``StepperNumerics`` is a base of ``PipelineStepper`` (``stepper.py``), which owns the state these
methods read. It holds what runs a graph rather than what steps the pipeline: ``forward`` on the
user's inputs, the eager model's reference logits on the probe batch, the one probe per step --
carried over from the previous step when nothing changed, read from the ``ProbeCache`` when an
earlier process computed it, and otherwise run (graphs from before ``weight_load`` with the eager
model's weights bound by name) -- the guard on rewrites that must keep the model's answer, and
``bisect`` over the probes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch

from ..errors import InputError
from ..models.devices import model_device
from ..models.export_contract import ProbeBatch
from .config import PipelineEntry
from .context import PipelineContext
from .graph.utils import graph_modules
from .interface import Stages, TransformRegistry
from .numerics import (
    GUARDED_STAGES,
    Numerics,
    NumericsMoved,
    ProbeError,
    compare_logits,
    exceeds,
    moved_beyond,
    rewrite_tolerance,
)
from .probe_cache import NodeTexts, ProbeCache, run_key, step_key, transform_source_key
from .snapshot import REPLACES_KEY, Snapshot
from .unloaded_run import run_unloaded
from .weights import unloaded_targets


class StepperNumerics:
    """``forward``, the reference logits, the per-step probes, the answer guard and ``bisect`` of
    ``PipelineStepper`` (a base of it)."""

    # Set by PipelineStepper.__init__ (see there).
    loaded: Any
    ctx: PipelineContext
    registry: TransformRegistry
    entries: List[PipelineEntry]
    snapshots: List[Snapshot]
    probe: ProbeBatch
    probe_cache: Optional[ProbeCache]
    numerics_enabled: bool
    _eager: torch.nn.Module
    _live: torch.nn.Module
    _reference: Optional[torch.Tensor]
    _probed: Optional[tuple]  # (module, probe function) the last probe ran on
    _probe_run_key: Optional[str]
    _node_texts: NodeTexts

    if TYPE_CHECKING:  # defined by PipelineStepper

        @property
        def done(self) -> bool: ...

        def index(self, key: str) -> int: ...

        def snapshot(self, key: str) -> Snapshot: ...

        def run(self) -> List[Snapshot]: ...

    def forward(self, *args: Any, at: Optional[str] = None) -> Any:
        """Run the live graph (or the snapshot ``at``) on ``args``: ``(input_ids, position_ids)``
        -> logits [batch, seq, vocab].

        Graphs from before ``load_weights`` hold meta tensors; they run here with the eager model's
        weights bound by name (``pipeline.unloaded_run.run_unloaded``), without changing the graph. A
        cached graph runs each row as one prefill on scratch caches (the numerics probe's
        ``CachedProbe``), so the logits are comparable with the uncached graph's and HF's.
        """
        mod = self.snapshot(at).module if at is not None else self._live
        if mod is None:
            raise InputError(f"the snapshot of {at} kept no graph copy: create the Workbench with snapshots=True")
        cached = any(
            s.stage.order >= Stages.CACHE_INIT.order for s in self.snapshots[: self.index(at) + 1 if at else None]
        )
        self._check_forward_args(args)
        probe = self.ctx.cache.probe
        if cached and probe is not None and len(args) == 2:
            with torch.no_grad():
                return probe(mod, ProbeBatch(*args))
        return self._call(mod, args)

    def reference_logits(self) -> torch.Tensor:
        if self._reference is None:
            where = model_device(self._eager)
            with torch.no_grad():
                ref = self._eager(*(a.to(where) for a in self.probe.args))
            if not bool(torch.isfinite(ref).all()):
                raise self._non_finite_reference(ref)
            self._reference = ref.to(self.ctx.device)
        return self._reference

    def _non_finite_reference(self, ref: torch.Tensor) -> InputError:
        """The eager model's own logits hold NaN/Inf: no transform can be checked against them.
        Names the parameters that hold them, if any (else the forward overflows)."""
        from ..models.load_checks import non_finite_parameters

        bad = non_finite_parameters(self.loaded.model)
        n = int((~torch.isfinite(ref)).sum())
        where = (
            f"its weights hold NaN or Inf ({'; '.join(bad)})"
            if bad
            else f"its forward overflows in {str(self.ctx.dtype).replace('torch.', '')} (no weight is NaN or Inf)"
        )
        return InputError(
            f"the eager model's logits on the probe batch hold {n:,} NaN/Inf values: {where}. Every numerics "
            "check would read nan: fix the weights (re-download or re-save them), or run with numerics off "
            "(Workbench(numerics=False), --no-numerics) to look at the graphs anyway"
        )

    def _check_forward_args(self, args: Sequence[Any]) -> None:
        """``input_ids`` [batch, seq] of token ids below the vocabulary size, and ``position_ids`` of
        the same shape: named here, not as an indexing error from inside
        an op of the graph."""
        if not args or not isinstance(args[0], torch.Tensor):
            return
        ids = args[0]
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InputError(
                f"forward: input_ids must be a 2-D integer tensor [batch, seq], got {ids.dtype} of shape "
                f"{tuple(ids.shape)} (one sequence: ids[None])"
            )
        vocab = self.ctx.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InputError(
                f"forward: input_ids hold ids outside the vocabulary 0..{vocab - 1} (min {int(ids.min())}, "
                f"max {int(ids.max())})"
            )
        if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].shape != ids.shape:
            raise InputError(
                f"forward: position_ids {tuple(args[1].shape)} must have input_ids' shape {tuple(ids.shape)}"
            )

    def _call(self, mod: torch.nn.Module, args: Sequence[Any]) -> Any:
        with torch.no_grad():
            if unloaded_targets(mod):
                return run_unloaded(mod, self.ctx.weights, args, self.ctx.device)
            return mod(*args)

    def _probe_error(self, snap: Snapshot) -> ProbeError:
        """Why the step that left ``snap`` fails when the numerics probe could not run on its graph
        (never "done"). The graph runs at the example shape it was exported or rewritten at, but not
        at the probe's shape (a guard the model's forward put in it, a shape the rewrite did not
        foresee): nothing later in the pipeline can be trusted on it."""
        assert snap.numerics is not None and snap.numerics.error is not None
        b, s = self.probe.input_ids.shape
        error = " ".join(snap.numerics.error.split())
        return ProbeError(
            f"the numerics probe could not run on the graph this transform left: {error} "
            f"(the eager model runs the probe batch input_ids [{b}, {s}]). Numerics off "
            "(Workbench(numerics=False), --no-numerics) skips the probe, not the problem"
        )

    def _moved_answer(self, entry: PipelineEntry, transform: Any, snap: Snapshot) -> Optional[NumericsMoved]:
        """Why this step changed the answer it should have kept (None: it kept it, or it may change
        it): a cleanup or matcher whose probe moved beyond ``rewrite_tolerance`` from the previous
        snapshot's. The message names the first node the rewrite made and what it replaced."""
        if entry.config.stage.value not in GUARDED_STAGES or transform.changes_numerics or not self.snapshots:
            return None
        tol = rewrite_tolerance(self.ctx.dtype)
        how = moved_beyond(self.snapshots[-1].numerics, snap.numerics, tol)
        if how is None:
            return None
        first, added = "", set(snap.added_nodes)
        for gm in graph_modules(self._live):
            node = next((n for n in gm.graph.nodes if n.name in added), None)
            if node is not None:
                replaced = node.meta.get(REPLACES_KEY) or []
                first = f"; the first node it rewrote: {node.name} ({node.target}"
                first += (
                    f", replacing {', '.join(replaced[:4])}{' ...' if len(replaced) > 4 else ''})" if replaced else ")"
                )
                break
        return NumericsMoved(
            f"{entry.key} changed the model's answer: {how}{first}. A {entry.config.stage.value} "
            f"transform only re-spells the computation, so this rewrite is wrong for this model: "
            f"run without it (--set {entry.key}.enabled=false) and report the spelling"
        )

    def _numerics(self, mod: torch.nn.Module, changed: bool, index: int) -> Numerics:
        """The probe's result for ``mod``. A transform that changed nothing (no node added or
        removed, no match) on the module the previous snapshot probed, with the same probe
        function, computes the same logits: its result is carried over (``carried_from`` names the
        snapshot that ran it) instead of running the model again. Failed probes are never carried."""
        prev = self.snapshots[-1] if self.snapshots else None
        if (
            not changed
            and prev is not None
            and prev.numerics is not None
            and prev.numerics.ok
            and self._probed is not None
            and self._probed[0] is mod
            and self._probed[1] is self.ctx.cache.probe
        ):
            return dataclasses.replace(prev.numerics, carried_from=prev.numerics.carried_from or prev.key)
        self._probed = (mod, self.ctx.cache.probe)
        key = self._probe_key(mod, index)
        cached = self.probe_cache.get(key) if self.probe_cache is not None and key is not None else None
        if cached is not None:
            return cached
        result = self._probe(mod)
        if self.probe_cache is not None and key is not None:
            self.probe_cache.put(key, result)
        return result

    def _probe_key(self, mod: torch.nn.Module, index: int) -> Optional[str]:
        """The probe cache's key for the graph transform ``index`` left (None: do not reuse)."""
        if self.probe_cache is None:
            return None
        entries = self.entries[: index + 1]
        sources = transform_source_key([self.registry.get(e.key) for e in entries])
        if sources is None:
            return None
        if self._probe_run_key is None:
            ref = self.reference_logits()
            self._probe_run_key = run_key(ref, self.probe.args, self.ctx.device, self.ctx.dtype)
        return step_key(self._probe_run_key, [e.config for e in entries], sources, mod, self._node_texts)

    def _probe(self, mod: torch.nn.Module) -> Numerics:
        probe = self.ctx.cache.probe
        try:
            with torch.no_grad():
                out = probe(mod, self.probe) if probe is not None else self._call(mod, self.probe.args)
        except Exception as e:  # noqa: BLE001 - reported in the result; step() then fails the step with it
            return Numerics(error=f"probe could not run: {type(e).__name__}: {e}"[:300])
        if not isinstance(out, torch.Tensor):
            return Numerics(error=f"probe returned {type(out).__name__}, not logits")
        return compare_logits(out, self.reference_logits())

    def bisect(self, tol: float = 1e-3, metric: str = "rmse_ratio") -> Optional[Snapshot]:
        """The first snapshot whose numerics cross ``tol`` (None if none does).

        Runs the pipeline to the end first if needed; probes that could not run are ignored.
        """
        if not self.numerics_enabled:
            raise RuntimeError("numerics are off for this run; create it with numerics=True")
        if not self.done:
            self.run()
        for snap in self.snapshots:
            if exceeds(snap.numerics, tol, metric):
                return snap
        return None


__all__ = ["StepperNumerics"]
