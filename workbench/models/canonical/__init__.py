"""Export-time canonicalization of HF modules whose computation no graph pattern can recover.

A Mamba-2 mixer's chunked scan, a gated-delta-rule layer or an MLA attention is hundreds of aten
nodes after export, spelled differently by every family (and often not exportable at all with a
dynamic sequence length: padding to the chunk size, data-dependent loops). For these mechanisms the
pattern_matcher stage would have nothing stable to match, so ``export_to_gm`` traces such modules
through a replacement ``forward`` that calls the canonical op (``torch.ops.workbench.torch_ssm``,
``torch_causal_conv1d``, ``torch_gated_delta_rule``, ``torch_mla``, ...) directly, with the
module's own weights. The eager HF model is never changed: every numerics probe compares the
canonical graph against HF's own forward, so a replacement that computes something else shows up
in the first probe after export.

Each replacement is a ``ModulePatch``: the HF class names it applies to (or a structural predicate
that recognises its mechanism under any class name) and the function that becomes ``forward`` of
each such instance, for the duration of one export only (``swap_forwards`` restores every instance
afterwards). They are switchable by name like every export patch
(``export_to_gm.patches: {canonical_mamba2_mixer: false}`` exports HF's own spelling).

One module per mechanism family (conv.py, ssm.py, delta_rule.py, mla.py, mrope.py), each exporting
``PATCHES``; ``MODULE_PATCHES`` is their union, read by ``pipeline/transforms/export/patches.py``.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class ModulePatch:
    """``forward`` of every module whose class name is in ``classes`` -- or which ``match`` accepts --
    becomes ``forward`` (called as ``forward(module, *args, **kwargs)``) while one export runs.

    ``match`` recognises a mechanism by its structure (attributes, parameter shapes) wherever a family
    puts it, under any class name. It may raise ``ValueError`` for a module that looks like its
    mechanism but lacks what ``forward`` reads: the export then stops with that message instead of
    tracing HF's own spelling of a mechanism the cache stage will not find."""

    name: str  # the export patch name, e.g. "canonical_mamba2_mixer"
    description: str
    classes: Tuple[str, ...]  # HF class names (matched by name: no transformers import needed here)
    forward: Callable[..., object]
    match: Optional[Callable[[torch.nn.Module], bool]] = None  # structural recognition, besides classes

    def applies_to(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ in self.classes or (self.match is not None and self.match(module))

    def targets(self, model: torch.nn.Module) -> List[torch.nn.Module]:
        return [m for m in model.modules() if self.applies_to(m)]


@contextlib.contextmanager
def swap_forwards(model: torch.nn.Module, patch: ModulePatch) -> Iterator[int]:
    """Give each target module the patch's ``forward`` (an instance attribute), then remove it again.
    Yields how many modules were patched."""
    targets = patch.targets(model)
    saved = [(m, m.__dict__.get("forward")) for m in targets]
    try:
        for m in targets:
            m.forward = types.MethodType(patch.forward, m)
        yield len(targets)
    finally:
        for m, old in saved:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = old


def refuse_cache(module: Any, cache_params: Any, states: str) -> None:
    """A canonical recurrent-mixer forward traces without a cache: refuse one (``states``: what the
    cache stage adds for this mixer, for the message)."""
    if cache_params is not None:
        raise ValueError(
            f"the canonical {type(module).__name__} forward traces the model without cache (export runs it with "
            f"use_cache=False; the cache stage adds the {states}): got a cache object. Switch the export "
            "patch off to run HF's own forward with a cache."
        )


def _collect() -> Tuple[ModulePatch, ...]:
    from . import conv, delta_rule, expert_loop, linear_attention, mamba1, mla, mrope, rglru, ssm

    patches = (*conv.PATCHES, *ssm.PATCHES, *delta_rule.PATCHES, *mla.PATCHES, *mrope.PATCHES)
    patches = (*patches, *linear_attention.PATCHES)
    patches = (*patches, *mamba1.PATCHES)
    patches = (*patches, *rglru.PATCHES)
    patches = (*patches, *expert_loop.PATCHES)
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise RuntimeError(f"duplicate canonical module patch names: {names}")
    return patches


MODULE_PATCHES: Tuple[ModulePatch, ...] = _collect()

__all__ = ["ModulePatch", "swap_forwards", "MODULE_PATCHES"]
