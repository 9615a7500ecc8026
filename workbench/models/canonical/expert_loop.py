"""Canonical forward of MoE experts that loop over the experts that received tokens.

transformers 5.x routes most families' experts through ``@use_experts_implementation`` (``grouped_mm``
/ ``batched_mm`` export, and ``match_moe_pattern`` turns them into ``torch_moe_fused``). A few
families keep their own loop instead (DBRX, LongCat-Flash)::

    expert_hit = (one_hot(top_k_index).sum(...) > 0).nonzero()
    for e in expert_hit:                        # data-dependent: which experts got tokens
        slot, tok = torch.where(mask[e])
        out.index_add_(0, tok, expert_e(x[tok]) * top_k_weights[tok, slot, None])

which ``torch.export`` cannot trace (``GuardOnDataDependentSymNode`` on the loop's length). Such an
experts module is recognised by its structure -- called as ``(hidden_states, top_k_index,
top_k_weights)``, not wrapped by transformers' experts interface, and holding its expert weights in
one of the layouts below -- and traced as one MoE op on views of its own weights (no copies):

* ``stacked``: ``gate_up_proj [E', 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` ->
  ``torch_moe_fused``. Experts ``E .. E'-1`` (LongCat-Flash's ``zero_expert_num``) are identities:
  their tokens add ``weight * x`` and skip the MLP;
* ``flat_glu``: DBRX's ``mlp.w1`` / ``mlp.v1`` / ``mlp.w2``, each ``[E * I, H]`` (``w2`` used as
  ``h @ w2_e``) -> ``torch_moe`` with per-expert views (``w2_e.T`` is the down projection).

The router stays HF's code (it runs before the experts module), so routing variants need nothing here.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from . import ModulePatch

#: The call an experts module of this kind takes (HF's experts interface's own names).
_SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
#: transformers' experts-interface wrapper: modules it wraps export through grouped_mm already.
_INTERFACE_FILE = "transformers/integrations/moe.py"


def _activation(module: Any) -> str:
    """The MoE op's activation name for the module's (or its config's) activation; ``ValueError``
    when none is found (a guessed activation would change the answer silently)."""
    config = getattr(module, "config", None)
    name = getattr(config, "hidden_act", None)
    ffn = getattr(config, "ffn_config", None)  # DBRX: ffn_config.ffn_act_fn = {"name": "silu"}
    if name is None and ffn is not None:
        act = getattr(ffn, "ffn_act_fn", None) or {}
        name = act.get("name") if isinstance(act, dict) else None
    fn = getattr(module, "act_fn", None) or getattr(getattr(module, "mlp", None), "activation_fn", None)
    if name is None and fn is not None:
        name = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "ReLU": "relu"}.get(
            type(fn).__name__
        )
    if name is None:
        raise ValueError(
            f"{type(module).__name__}: cannot tell its experts' activation (no config.hidden_act, DBRX "
            "ffn_config.ffn_act_fn or known act_fn module); switch the canonical_expert_loop export patch off"
        )
    return name


def expert_layout(module: torch.nn.Module) -> Optional[str]:
    """``"stacked"`` / ``"flat_glu"`` for an expert-loop module (module docstring), else None."""
    forward = type(module).forward
    # the interface's wrapper copies the wrapped forward's name and module (functools.wraps): its code's
    # file tells it apart
    code = getattr(forward, "__code__", None)
    if code is None or code.co_filename.replace("\\", "/").endswith(_INTERFACE_FILE):
        return None
    try:
        params = tuple(inspect.signature(forward).parameters)[1:]
    except (TypeError, ValueError):
        return None
    if params != _SIGNATURE:
        return None
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3:
        e, hidden, inter = down.shape
        if gate_up.shape[0] >= e and tuple(gate_up.shape[1:]) == (2 * inter, hidden):
            return "stacked"
    mlp = getattr(module, "mlp", None)
    flat = [w for w in (getattr(mlp, n, None) for n in ("w1", "v1", "w2")) if isinstance(w, torch.Tensor)]
    if len(flat) == 3 and all(w.dim() == 2 for w in flat) and len({w.shape for w in flat}) == 1:
        return "flat_glu"
    return None


def expert_loop_forward(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights):
    """The experts of an expert-loop module as one MoE op: hidden_states [T, H] (or [b, s, H]),
    top_k_index / top_k_weights [T, k] -> [T, H] (the input's shape)."""
    import workbench.ops.moe  # noqa: F401  (registers the ops)

    wb = torch.ops.workbench
    act = _activation(module)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if expert_layout(module) == "flat_glu":
        mlp = module.mlp
        hidden = x.shape[-1]
        experts = mlp.w1.shape[0] // module.ffn_hidden_size
        w1, v1, w2 = (w.view(experts, -1, hidden) for w in (mlp.w1, mlp.v1, mlp.w2))
        out = wb.torch_moe(
            x, top_k_index, top_k_weights, list(w1.unbind(0)), [w.t() for w in w2.unbind(0)], list(v1.unbind(0)), act
        )
        return out.view(hidden_states.shape[0], -1, hidden)  # HF's DBRX output shape: [dim 0, -1, H]
    routed = module.down_proj.shape[0]
    if module.gate_up_proj.shape[0] == routed:  # no identity experts
        out = wb.torch_moe_fused(x, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, act)
        return out.reshape(hidden_states.shape)
    # identity ("zero") experts past the routed ones: -1 for the MoE op (skipped), weight * x instead
    is_routed = top_k_index < routed
    index = torch.where(is_routed, top_k_index, torch.full_like(top_k_index, -1))
    out = wb.torch_moe_fused(x, index, top_k_weights, module.gate_up_proj[:routed], module.down_proj, act)
    identity = (top_k_weights * (~is_routed).to(top_k_weights.dtype)).sum(-1, keepdim=True)
    return (out + (x * identity).to(out.dtype)).reshape(hidden_states.shape)


PATCHES: tuple = (
    ModulePatch(
        "canonical_expert_loop",
        "MoE experts that loop over the experts that received tokens (DBRX, LongCat-Flash; recognised by "
        "their call signature and weight layout under any class name) as torch_moe / torch_moe_fused: the "
        "data-dependent loop does not export.",
        (),
        expert_loop_forward,
        match=lambda m: expert_layout(m) is not None,
    ),
)
