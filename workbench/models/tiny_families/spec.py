"""A tiny config as data: the family's config class and the fields to build it with.

Most tiny builders only name a config class and its fields (the shared sizes of ``sizes.py`` plus what
is particular to the family), so the families' modules hold tables of :class:`TinyConfig` rather than
one function per family; a builder with real logic (registering a model class first, say) stays a
function. A ``TinyConfig`` is itself a zero-argument builder: ``TINY_ARCHS`` holds both kinds alike.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported when a config is built: it costs ~2 s.
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class TinyConfig:
    """Builds ``family``'s config from ``fields`` when called (no arguments), a fresh object per call.

    ``family`` is the config class's name in ``transformers`` (``"BloomConfig"``) or, for the families
    configured by model type (classes transformers names irregularly or does not export), the model
    type (``"youtu"``, built through ``AutoConfig.for_model``): a name ending in ``Config`` is a class.
    ``attention``, when set, becomes the config's ``_attn_implementation`` (``"eager"`` for families
    without an SDPA path); unset, ``build_tiny_config`` chooses it.
    """

    family: str
    fields: Mapping[str, Any]
    attention: str | None = None

    def __call__(self) -> PretrainedConfig:
        import transformers

        # deep-copied: a config keeps the lists it is given, and a caller may mutate its config freely
        fields = copy.deepcopy(dict(self.fields))
        if self.family.endswith("Config"):
            config = getattr(transformers, self.family)(**fields)
        else:
            config = transformers.AutoConfig.for_model(self.family, **fields)
        if self.attention is not None:
            config._attn_implementation = self.attention
        return config


def tiny_config(family: str, *presets: Mapping[str, Any], attention: str | None = None, **fields: Any) -> TinyConfig:
    """``family``'s :class:`TinyConfig` with the ``presets`` merged in order, then ``fields``: a later
    value wins, so a family overrides a shared preset by naming the field again
    (``tiny_config("GPTJConfig", GPT_SIZES, ORACLE, initializer_range=0.2)``)."""
    merged: dict[str, Any] = {}
    for preset in presets:
        merged.update(preset)
    merged.update(fields)
    return TinyConfig(family, MappingProxyType(merged), attention)


__all__ = ["TinyConfig", "tiny_config"]
