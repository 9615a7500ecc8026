"""Export patches: small, named context managers that work around HF quirks during export.

Each patch is switchable from ``export_to_gm``'s ``patches`` field (``{name: bool}``); the table
here is filled once at import time and never mutated afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List

import torch

from ...._compat import hf_packed_sequence_detection_disabled
from ....models.canonical import MODULE_PATCHES, ModulePatch, swap_forwards


@dataclass(frozen=True)
class ExportPatch:
    name: str
    description: str
    enabled_by_default: bool
    # Builds the context manager for one export of ``model``.
    enter: Callable[[torch.nn.Module], ContextManager]


def _no_packed_sequence_mask(model: torch.nn.Module) -> ContextManager:
    return hf_packed_sequence_detection_disabled()


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Export in eval mode (dropout off) and restore the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class _TensorLiteralsOnCPU(torch.overrides.TorchFunctionMode):
    """``torch.tensor(<python number>, device=meta)`` made on CPU instead: 0-dim only, the one shape a
    CPU tensor may mix with tensors of another device in."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and args and isinstance(args[0], (bool, int, float)):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _tensor_literals_on_cpu(model: torch.nn.Module) -> Iterator[None]:
    with _TensorLiteralsOnCPU():
        yield


def _module_patch_enter(patch: ModulePatch) -> Callable[[torch.nn.Module], ContextManager]:
    return lambda model: swap_forwards(model, patch)


EXPORT_PATCHES: Dict[str, ExportPatch] = {
    p.name: p
    for p in [
        ExportPatch(
            "no_packed_sequence_mask",
            "Skip transformers' packed-sequence detection from position_ids, which otherwise "
            "materialises a position-dependent attention mask (diff/cumsum/index) in the graph.",
            True,
            _no_packed_sequence_mask,
        ),
        ExportPatch(
            "eval_mode",
            "Export with the model in eval mode (no dropout), restoring its mode afterwards.",
            True,
            _eval_mode,
        ),
        ExportPatch(
            "tensor_literals_on_cpu",
            "Make torch.tensor(<python numbers>, device=meta) on CPU while tracing on meta: export lifts "
            "such literals into graph constants, and made on meta their values would be lost (e.g. "
            "transformers 5.17's eager mask, torch.where(mask, torch.tensor(0.0, device=mask.device), "
            "min)). A 0-dim CPU constant mixes with tensors of any device, so the graph stays "
            "device-neutral and the numbers survive.",
            True,
            _tensor_literals_on_cpu,
        ),
    ]
}
# Canonical forwards of HF modules no graph pattern can recover (SSM mixers, delta-rule layers, MLA):
# see ``workbench.models.canonical``. On by default; each touches only modules of its own classes.
EXPORT_PATCHES.update(
    {p.name: ExportPatch(p.name, p.description, True, _module_patch_enter(p)) for p in MODULE_PATCHES}
)


def resolve_patches(overrides: Dict[str, bool]) -> List[ExportPatch]:
    """The patches to apply: defaults, with ``overrides`` switching individual ones on or off."""
    unknown = sorted(set(overrides) - set(EXPORT_PATCHES))
    if unknown:
        raise ValueError(f"unknown export patch(es) {unknown}; known: {sorted(EXPORT_PATCHES)}")
    return [p for name, p in EXPORT_PATCHES.items() if overrides.get(name, p.enabled_by_default)]


@contextlib.contextmanager
def apply_patches(patches: List[ExportPatch], model: torch.nn.Module) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p.enter(model))
        yield
