"""Canonical forward of the mRoPE rotary table (Qwen2-VL, Qwen2.5-VL text stacks).

Why a patch, although the rotation itself is ordinary rotate-half RoPE (``match_rope_pattern``
finds it in the attention as for Llama): the *table* is spelled as ``expand(3, ...)``, a product,
cos/sin, a split into ``mrope_section`` runs, a per-section ``select`` and two ``cat`` -- some 20
aten nodes with nothing stable to match -- and ``initialize_mrope_delta_cache`` must find the
positions that feed it to add each sequence's ``rope_deltas`` offset. Traced through
``torch_mrope_cos_sin``, the table is one node whose first argument is those positions.

HF's ``forward(x, position_ids)`` (``position_ids`` [3, b, s], or [b, s]) returns cos/sin
``[b, s, head_dim]`` in ``x``'s dtype; so does this, from the module's own ``inv_freq`` and
``attention_scaling`` (so default, linear and YaRN-style scaled tables all come out as HF's).

Left to HF's own forward (traced as it is; the delta cache then cannot be inserted and says so):
* rope types that recompute ``inv_freq`` from the positions at run time (``dynamic``, ``longrope``:
  a data-dependent branch);
* a transformers whose rotary module returns the unselected ``[3, b, s, d]`` table and lets the
  attention pick the sections (``apply_multimodal_rotary_pos_emb``; no ``recomposition_frequencies``
  method on the class): returning ``[b, s, d]`` there would be wrong.
"""

from __future__ import annotations

from typing import Any

import torch

from ...ops.rope import torch_mrope as _mrope_ops  # noqa: F401  (registers workbench::torch_mrope_cos_sin)
from . import ModulePatch

_RUNTIME_RECOMPUTED = ("dynamic", "longrope")


def _hf_forward(module: Any):
    """The class's own forward, bound (the patch is an instance attribute shadowing it)."""
    return type(module).forward.__get__(module, type(module))


def traceable_as_op(module: Any) -> str | None:
    """Why the module's table cannot go through ``torch_mrope_cos_sin`` (None: it can)."""
    if not hasattr(type(module), "recomposition_frequencies"):
        return "its rotary module leaves the section selection to the attention (older transformers)"
    if getattr(module, "rope_type", "default") in _RUNTIME_RECOMPUTED:
        return f"rope_type {module.rope_type!r} recomputes inv_freq from the positions at run time"
    if not isinstance(getattr(module, "mrope_section", None), (list, tuple)):
        return "the rotary module has no mrope_section"
    return None


def canonical_mrope_rotary(module: Any, x: torch.Tensor, position_ids: torch.Tensor):
    """``Qwen2(_5)_VLRotaryEmbedding.forward`` through ``torch.ops.workbench.torch_mrope_cos_sin``:
    x [b, s, hidden] (dtype and device only), position_ids [3, b, s] or [b, s] -> cos, sin [b, s, d]."""
    if traceable_as_op(module) is not None:
        return _hf_forward(module)(x, position_ids)
    cos, sin = torch.ops.workbench.torch_mrope_cos_sin(
        position_ids, module.inv_freq, [int(n) for n in module.mrope_section], float(module.attention_scaling)
    )
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


PATCHES: tuple = (
    ModulePatch(
        "canonical_mrope_rotary",
        "Trace the mRoPE rotary table of Qwen2-VL / Qwen2.5-VL (3-section positions) as one "
        "torch_mrope_cos_sin node, whose positions initialize_mrope_delta_cache can offset.",
        ("Qwen2_5_VLRotaryEmbedding", "Qwen2VLRotaryEmbedding"),
        canonical_mrope_rotary,
    ),
)
