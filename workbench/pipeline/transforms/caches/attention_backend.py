"""The cached-attention backend choice both cache modes share: ``insert_cached_attention`` (graph)
and ``transformers_replace_cached_attn`` (HF model) take the same ``backend`` field, validated
against ``workbench.ops.backends.ATTENTION_BACKENDS`` and picked when the transform runs.

``auto`` (or unset) takes the first backend of ``ATTENTION_AUTO[device type]`` that runs on the
device *and* serves every layer's shape: on CUDA FlashInfer (installed, half precision, head dim
64/128/256, no sinks), else Triton -- both captured by CUDA graphs -- and the host-syncing torch
reference last; on CPU the C++ kernel, else torch. The reason, with what was passed over and why,
goes into the snapshot's details (``chosen``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from pydantic import Field, field_validator

from ....ops.backends import ATTENTION_BACKENDS, AttentionBackend
from ....ops.registry import Choice
from ...interface import TransformConfig

FIELD = "insert_cached_attention.backend"


@dataclass(frozen=True)
class LayerShape:
    """What a backend's ``unsupported`` hook is asked about one attention layer."""

    layer: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    has_sinks: bool
    chunk_size: Optional[int] = None  # chunked local attention (Llama 4): refused by backends without it
    has_alibi: bool = False  # ALiBi slopes (BLOOM, MPT, Falcon-RW): refused by backends without them


def unsupported_layers(backend: AttentionBackend, layers: Sequence[LayerShape]) -> Dict[str, List[int]]:
    """Why ``backend`` cannot serve some layers -> those layers (empty: it serves them all)."""
    refused: Dict[str, List[int]] = {}
    for s in layers:
        why = backend.unsupported(s.head_dim, s.v_head_dim, s.dtype, s.has_sinks)
        if why is None and s.chunk_size is not None:
            why = backend.unsupported_chunked()
        if why is None and s.has_alibi:
            why = backend.unsupported_alibi()
        if why:
            refused.setdefault(why, []).append(s.layer)
    return refused


def describe_refusal(refused: Dict[str, List[int]]) -> str:
    return "; ".join(
        f"{why} (layers {layers[:4]}{'...' if len(layers) > 4 else ''})" for why, layers in refused.items()
    )


def resolve_backend(
    name: Optional[str],
    device: torch.device,
    layers: Sequence[LayerShape] = (),
    agree: Callable[[Any], Any] = lambda measured: measured,
) -> Choice[AttentionBackend]:
    """The attention backend for ``name`` on ``device`` and why (``BackendRegistry.choose``): an
    explicit name that cannot run or serve a layer of ``layers`` is a clear error naming what it
    needs and what to use instead; ``None``/``auto``: the first backend of ``ATTENTION_AUTO`` that
    runs here and serves every layer; on a CPU in the order this CPU measured them
    (``ops/cpu_kernels/calibrate.py``; ``agree``: the ranks of a sharded run take rank 0's, ``DistInfo.agree``)."""
    measured = None
    if name in (None, "auto") and torch.device(device).type == "cpu":
        from ....ops.cpu_kernels.calibrate import attention_choice

        m = agree(attention_choice())
        measured = (tuple(sorted(m.times, key=lambda c: m.times[c])), m.evidence())
    return ATTENTION_BACKENDS.choose(
        name, device, FIELD, refuse=lambda b: describe_refusal(unsupported_layers(b, layers)) or None, measured=measured
    )


class InsertCachedAttentionConfig(TransformConfig):
    backend: Optional[str] = Field(
        default=None,
        description=f"The attention backend to use: auto | {' | '.join(ATTENTION_BACKENDS.names())} "
        "(auto or None: the fastest that runs on the device and serves every layer's shape: on CUDA flashinfer, "
        "else triton, else torch; on CPU the C++ kernel (cpu), else torch). The choice and why are in the "
        "snapshot's details.",
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


__all__ = ["InsertCachedAttentionConfig", "LayerShape", "resolve_backend", "unsupported_layers"]
