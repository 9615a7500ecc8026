"""The cached-attention backend choice both cache modes share: ``insert_cached_attention`` (graph)
and ``transformers_replace_cached_attn`` (HF model) take the same ``backend`` field, validated
against ``workbench.ops.backends.ATTENTION_BACKENDS`` and picked (with the reason it cannot run
here, if it cannot) when the transform runs."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from pydantic import Field, field_validator

from ..ops.backends import ATTENTION_AUTO, ATTENTION_BACKENDS
from .interface import TransformConfig


def resolve_backend(name: Optional[str], device: torch.device) -> Tuple[str, Callable]:
    """The backend's name and op; a RuntimeError saying what is missing when it cannot run here.
    ``None``: the first of ``ATTENTION_AUTO[device type]`` that runs here (the C++ kernel on CPU)."""
    if name in (None, "auto"):
        chosen, _ = ATTENTION_BACKENDS.first_runnable(ATTENTION_AUTO.get(torch.device(device).type, ()), device)
        name = chosen.name if chosen is not None else None
    backend = ATTENTION_BACKENDS.pick(name, device, "insert_cached_attention.backend")
    return backend.name, backend.op


class InsertCachedAttentionConfig(TransformConfig):
    backend: Optional[str] = Field(
        default=None,
        description=f"The attention backend to use: auto | {' | '.join(ATTENTION_BACKENDS.names())} "
        "(auto or None: the fastest that runs on the device: cpu, else torch, on CPU; torch on CUDA).",
    )

    require_cached_attention: bool = Field(
        default=False,
        description="Make attention the pattern matcher left uncanonicalized (SDPA with an explicit mask, an "
        "eager matmul + softmax chain, a torch_attention the cache cannot serve) an error instead of a "
        "warning: without a KV cache for those layers, generate re-runs the whole sequence every step.",
    )

    @field_validator("backend")
    @classmethod
    def _known(cls, v: Optional[str]) -> Optional[str]:
        if v not in (None, "auto"):
            ATTENTION_BACKENDS.get(v)  # ValueError: "unknown attention backend ...; known: ..."
        return v


__all__ = ["InsertCachedAttentionConfig", "resolve_backend"]
