"""Canonical mixture-of-experts ops: per-expert lists, stacked ("fused") weights, dense BMM form.

Shapes: ``T`` tokens, ``H`` hidden, ``I`` expert intermediate, ``E`` experts, ``k`` experts per
token. Every expert is a gated MLP ``down(act(gate(x)) * up(x))`` with weights in ``nn.Linear``
layout (``[out, in]``). The token/expert combination is summed over the ``k`` slots in slot order
and cast back to ``x``'s dtype, as HF's MoE blocks do, so a match is numerically faithful.

``torch_moe_fused`` also carries what gpt-oss's experts add (``expert_mlp.py``): per-expert biases,
gate/up rows interleaved, and the clamped SwiGLU (``act_fn="clamped_swiglu"``, ``swiglu_alpha``,
``swiglu_limit``). Every rewrite of a ``torch_moe_fused`` node either carries these options over or
leaves the node alone and says why (``has_expert_extras`` below names them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

from ..library import workbench_op
from .expert_mlp import PLAIN_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation, expert_mlp

# why the MoE ops that dispatch tokens to experts cannot be captured in a CUDA graph
MOE_HOST_SYNC = "runs only the experts that got tokens: reads them on the host (unique().tolist(), nonzero)"
ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = dict(PLAIN_ACTIVATIONS)


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def has_expert_extras(args: Mapping[str, Any]) -> List[str]:
    """The options of a ``torch_moe_fused`` call (its arguments by name, defaults filled in) beyond the
    plain gated MLP: what an op or rewrite that only knows ``act(gate) * up`` without biases must
    refuse, by these names."""
    extras = []
    if args.get("w1_w3_bias") is not None or args.get("w2_bias") is not None:
        extras.append("expert biases")
    if args.get("gate_up_interleaved"):
        extras.append("interleaved gate/up rows")
    if args.get("act_fn", "silu") not in ACTIVATIONS:
        extras.append(f"act_fn={args['act_fn']!r}")
    return extras


def _combine(
    x: torch.Tensor,
    selected_experts: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_j routing_weights[t, j] * expert_{selected[t, j]}(x[t])`` -> [*x.shape].

    x [..., H] (flattened to [T, H]); selected_experts/routing_weights [T, k]. Only experts that
    received tokens run. The per-slot results are summed over ``k`` in slot order. An expert id of
    -1 (``torch_moe_local_experts``: an expert another rank holds) contributes nothing here.
    """
    hidden = x.shape[-1]
    xt = x.reshape(-1, hidden)
    sel = selected_experts.reshape(xt.shape[0], -1)
    weights = routing_weights.reshape(sel.shape)
    out_dtype = torch.promote_types(x.dtype, weights.dtype)
    slots = xt.new_zeros(*sel.shape, hidden, dtype=out_dtype)  # [T, k, H]
    for e in sel.unique().tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(sel == e, as_tuple=True)
        slots[tok, slot] = expert_fn(int(e), xt[tok]) * weights[tok, slot, None]
    return slots.sum(dim=1).to(x.dtype).reshape(x.shape)


@workbench_op("torch_moe", category="moe", host_sync=MOE_HOST_SYNC)
def torch_moe(
    x: torch.Tensor,
    selected_experts: torch.Tensor,
    routing_weights: torch.Tensor,
    w1_weight: List[torch.Tensor],
    w2_weight: List[torch.Tensor],
    w3_weight: List[torch.Tensor],
    act_fn: str = "silu",
) -> torch.Tensor:
    """MoE with one weight tensor per expert (the form sharding splits across devices).

    x [..., H]; selected_experts [T, k] (int); routing_weights [T, k]; w1 (gate) and w3 (up)
    lists of E tensors [I, H]; w2 (down) list of E tensors [H, I] -> [..., H].
    """
    act = _act(act_fn)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        return F.linear(act(F.linear(xe, w1_weight[e])) * F.linear(xe, w3_weight[e]), w2_weight[e])

    return _combine(x, selected_experts, routing_weights, expert)


@torch_moe.register_fake
def _torch_moe_fake(x, selected_experts, routing_weights, w1_weight, w2_weight, w3_weight, act_fn="silu"):
    return torch.empty_like(x)


@workbench_op("torch_moe_fused", category="moe", host_sync=MOE_HOST_SYNC)
def torch_moe_fused(
    x: torch.Tensor,
    selected_experts: torch.Tensor,
    routing_weights: torch.Tensor,
    w1_w3_stacked: torch.Tensor,
    w2_stacked: torch.Tensor,
    act_fn: str = "silu",
    w1_w3_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """MoE with stacked expert weights (HF transformers>=5 ``experts.gate_up_proj/down_proj``).

    x [..., H]; selected_experts/routing_weights [T, k]; w1_w3_stacked [E, 2I, H] with the gate
    (w1) rows first, then up (w3) -- or alternating gate, up rows with ``gate_up_interleaved``
    (gpt-oss); w2_stacked [E, H, I]; optional biases w1_w3_bias [E, 2I] (same row order) and
    w2_bias [E, H] -> [..., H]. ``act_fn``: silu / gelu / relu (``act(gate) * up``) or
    clamped_swiglu (gpt-oss, with ``swiglu_alpha`` and ``swiglu_limit``; ``expert_mlp.py``).
    """
    check_activation(act_fn)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        return expert_mlp(
            xe,
            w1_w3_stacked[e],
            w2_stacked[e],
            act_fn,
            None if w1_w3_bias is None else w1_w3_bias[e],
            None if w2_bias is None else w2_bias[e],
            gate_up_interleaved,
            swiglu_alpha,
            swiglu_limit,
        )

    return _combine(x, selected_experts, routing_weights, expert)


@torch_moe_fused.register_fake
def _torch_moe_fused_fake(x, selected_experts, routing_weights, w1_w3_stacked, w2_stacked, *args, **kwargs):
    return torch.empty_like(x)


@workbench_op("torch_moe_local_experts", category="moe")
def torch_moe_local_experts(selected_experts: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Expert parallelism: global expert ids [T, k] -> this rank's local ids, or -1 for an expert
    another rank holds (experts ``first_expert .. first_expert + num_local - 1`` live here)."""
    local = selected_experts - first_expert
    keep = (local >= 0) & (local < num_local)
    return torch.where(keep, local, torch.full_like(local, -1))


@torch_moe_local_experts.register_fake
def _torch_moe_local_experts_fake(selected_experts, first_expert, num_local):
    return torch.empty_like(selected_experts)


@workbench_op("torch_moe_dense_mlp", category="moe")
def torch_moe_dense_mlp(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    w1_w3_stacked: torch.Tensor,
    w2_stacked: torch.Tensor,
    act_fn: str = "silu",
    apply_routing_on_input: bool = False,
    up_first: bool = False,
) -> torch.Tensor:
    """The dense/BMM form: every expert runs on every token, weighted by a dense routing matrix.

    x [..., H]; routing_weights [T, E] (zero where an expert was not selected); w1_w3_stacked
    [E, 2I, H] (gate rows first, then up; ``up_first``: up rows first, as models that write
    ``up, gate = h.chunk(2)`` store them); w2_stacked [E, H, I] -> [..., H]. With
    ``apply_routing_on_input`` (Llama-4 style, top-1) the weight scales the expert's *input*
    instead of its output.
    """
    act = _act(act_fn)
    hidden = x.shape[-1]
    xt = x.reshape(-1, hidden)
    r = routing_weights.reshape(xt.shape[0], -1).transpose(0, 1)[..., None]  # [E, T, 1]
    xe = xt.unsqueeze(0).expand(r.shape[0], -1, -1)  # [E, T, H]
    if apply_routing_on_input:
        xe = xe * r
    gate, up = torch.bmm(xe.to(w1_w3_stacked.dtype), w1_w3_stacked.transpose(1, 2)).chunk(2, dim=-1)
    if up_first:
        gate, up = up, gate
    y = torch.bmm(act(gate) * up, w2_stacked.transpose(1, 2))  # [E, T, H]
    if not apply_routing_on_input:
        y = y * r
    return y.sum(dim=0).to(x.dtype).reshape(x.shape)


@torch_moe_dense_mlp.register_fake
def _torch_moe_dense_mlp_fake(
    x, routing_weights, w1_w3_stacked, w2_stacked, act_fn="silu", apply_routing_on_input=False, up_first=False
):
    return torch.empty_like(x)
