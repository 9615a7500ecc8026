"""Canonical forward of decayed linear attention: MiniMax's lightning attention.

HF's ``MiniMaxLightningAttention`` (transformers 5.23) computes, per head, the recurrence
``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` (no scale) in blocks of
``config.block_size`` tokens: a Python loop over ``ceil(s / block_size)`` blocks with
``min(start + block_size, s)`` slices, which bakes the traced sequence length into the graph
(export fails with "Guard failed: min(16, input_ids.size()[1]) != 16"). The replacement keeps the
layer's surroundings as plain module calls -- the fused q/k/v projection and its activation, the
RMSNorm over all heads, the sigmoid output gate and ``out_proj`` -- and routes only the recurrence
through ``torch_linear_attention``, which the cache stage turns into a state-slot op::

    qkv_proj -> act_fn -> [b, s, h, 3d] -> q, k, v [b, s, h, d]
      -> torch_linear_attention(q, k, v, g = -slope_rate expanded to [b, s, h])  -> [b, s, h, d]
      -> norm(o [b, s, h*d]) * sigmoid(output_gate(hidden_states)) -> out_proj

The patch finds its modules by mechanism as well as by class name: any module with a fused
``qkv_proj`` of ``3 * heads * head_dim`` outputs, an ``output_gate`` and an ``out_proj``, a ``norm``,
an ``act_fn`` and a per-head ``slope_rate`` buffer of ``heads`` values is this layer, under whatever
class name a fork gives it.

The forward runs only while ``export_to_gm`` traces a model without cache: a cache object is
refused (the cache stage adds the state).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ...ops import linear_attention as _linear_attention_ops  # noqa: F401  (registers the op)
from . import ModulePatch, refuse_cache

#: HF classes of lightning attention (also found by structure, ``is_lightning_attention``).
LIGHTNING_CLASSES: Tuple[str, ...] = ("MiniMaxLightningAttention",)


def is_lightning_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` has lightning attention's structure (module docstring), whatever its class."""
    if type(module).__name__ in LIGHTNING_CLASSES:
        return True
    heads, head_dim = getattr(module, "num_attention_heads", None), getattr(module, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return False
    qkv, gate, out = (getattr(module, n, None) for n in ("qkv_proj", "output_gate", "out_proj"))
    if not (
        isinstance(qkv, torch.nn.Linear) and isinstance(gate, torch.nn.Linear) and isinstance(out, torch.nn.Linear)
    ):
        return False
    slope = getattr(module, "slope_rate", None)
    return (
        qkv.out_features == 3 * heads * head_dim
        and gate.out_features == heads * head_dim
        and isinstance(getattr(module, "norm", None), torch.nn.Module)
        and callable(getattr(module, "act_fn", None))
        and isinstance(slope, torch.Tensor)
        and slope.numel() == heads
    )


def lightning_attention_forward(
    module: Any,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    cache: Any = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """``MiniMaxLightningAttention``: hidden_states [b, s, hidden] -> ([b, s, hidden], None), HF's
    uncached forward with the recurrence as ``torch_linear_attention`` (no rotary: the position
    embeddings are unused, as in HF)."""
    refuse_cache(module, cache if cache is not None else kwargs.get("past_key_values"), "linear-attention state")
    b, s, _ = hidden_states.shape
    h, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2:  # HF zeroes padded tokens' q/k/v
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    q, k, v = qkv.unflatten(-1, (h, 3 * d)).split(d, dim=-1)  # each [b, s, h, d]
    # a constant decay per head: exp(-slope_rate) every token (fp32: it compounds over the sequence)
    g = -module.slope_rate.reshape(1, 1, h).to(torch.float32).expand(b, s, h)
    o = torch.ops.workbench.torch_linear_attention(q, k, v, g)  # [b, s, h, d]
    o = module.norm(o.flatten(-2))
    o = torch.sigmoid(module.output_gate(hidden_states)) * o
    return module.out_proj(o), None


PATCHES: tuple = (
    ModulePatch(
        "canonical_lightning_attention",
        "Trace lightning attention (MiniMaxLightningAttention, or any module of its structure) as "
        "qkv_proj -> act -> torch_linear_attention(decay exp(-slope_rate)) -> norm -> sigmoid gate -> out_proj "
        "instead of HF's block loop (which bakes the sequence length into the graph).",
        LIGHTNING_CLASSES,
        lightning_attention_forward,
        match=is_lightning_attention,
    ),
)

__all__ = ["PATCHES", "LIGHTNING_CLASSES", "is_lightning_attention", "lightning_attention_forward"]
