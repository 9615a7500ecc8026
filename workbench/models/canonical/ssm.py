"""Canonical forwards of the Mamba-2 mixers (Mamba-2, Bamba, NemotronH, Falcon-H1).

HF's no-kernel path (``torch_forward`` / the ``mamba2_chunk_scan`` fallback) spells the SSD scan as
padding to whole chunks, segment sums and half a dozen einsums: hundreds of nodes, different in
every family and version. The replacement keeps every mixer's surroundings as plain module calls
(``in_proj``, the gated ``norm``, ``out_proj``: the usual matchers still see linears and norms) and
routes the two recurrent pieces through canonical ops, each of which the cache stage turns into a
state-slot op::

    in_proj -> split [gate | x,B,C | dt] -> torch_causal_conv1d(silu) -> split [x | B | C]
            -> torch_ssm(x, A=-exp(A_log), B, C, D, dt, dt_bias) -> norm(y, gate) -> out_proj

These forwards run only while ``export_to_gm`` traces a model without cache: HF's cache object,
when given, is refused (the cache stage adds the state), and the padding mask is ignored -- the
export contract has none, and the runtime never pads (HF only zeroes padded tokens with it).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ...ops import conv as _conv_ops  # noqa: F401  (registers workbench::torch_causal_conv1d)
from ...ops import ssm as _ssm_ops  # noqa: F401  (registers workbench::torch_ssm)
from . import ModulePatch, refuse_cache


def _time_step_limits(module: Any) -> Tuple[float, Optional[float]]:
    """HF's ``time_step_limit`` (min, max) as the op's options; an infinite max is ``None``."""
    low, high = module.time_step_limit
    return float(low), (None if math.isinf(high) else float(high))


def _conv_and_scan(module: Any, projected: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The mixer's core from its in_proj output [b, s, P]: returns (gate [b, s, I], y [b, s, I]).

    Shared by every Mamba-2 mixer: they name their sizes alike (``intermediate_size``, ``conv_dim``,
    ``num_heads``, ``head_dim``, ``n_groups``, ``ssm_state_size``) and store conv1d, A_log, D, dt_bias.
    """
    heads, head_dim = module.num_heads, module.head_dim
    groups, state = module.n_groups, module.ssm_state_size
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    # The conv runs in its weight's dtype and hands back the input's, as HF's causal_conv1d_fn does:
    # they differ when a float32 buffer (Falcon-H1's mup_vector in a bf16 model) promoted in_proj's
    # output. Casts only then (a dtype is static at trace time), so fp32 graphs get no cast nodes.
    weight = module.conv1d.weight
    conv_in = xbc if xbc.dtype == weight.dtype else xbc.to(weight.dtype)
    conv_out = torch.ops.workbench.torch_causal_conv1d(
        conv_in, weight, module.conv1d.bias, activation=module.activation
    )
    xbc = conv_out if conv_out.dtype == xbc.dtype else conv_out.to(xbc.dtype)
    x, B, C = xbc.split([module.intermediate_size, groups * state, groups * state], dim=-1)
    low, high = _time_step_limits(module)
    y = torch.ops.workbench.torch_ssm(
        x.unflatten(-1, (heads, head_dim)),
        -torch.exp(module.A_log.float()),
        B.unflatten(-1, (groups, state)),
        C.unflatten(-1, (groups, state)),
        module.D,
        dt,
        module.dt_bias,
        time_step_min=low,
        time_step_max=high,
        chunk_size=module.chunk_size,
    )
    return gate, y.flatten(-2)


def mamba2_mixer_forward(module: Any, hidden_states: torch.Tensor, cache_params=None, *_args, **_kwargs):
    """``Mamba2Mixer`` / ``BambaMixer`` / ``NemotronHMamba2Mixer``: hidden_states [b, s, hidden] ->
    [b, s, hidden]. The gated norm multiplies by silu(gate) before normalizing (HF's
    ``MambaRMSNormGated``, run as the module itself)."""
    refuse_cache(module, cache_params, "SSM and conv state")
    gate, y = _conv_and_scan(module, module.in_proj(hidden_states))
    return module.out_proj(module.norm(y, gate).to(hidden_states.dtype))


def falcon_h1_mixer_forward(module: Any, hidden_states: torch.Tensor, cache_params=None, *_args, **_kwargs):
    """``FalconH1Mixer``: a Mamba-2 mixer with muP multipliers -- the input scaled by
    ``ssm_in_multiplier``, the in_proj output by the per-channel ``mup_vector`` (one factor per
    gate / x / B / C / dt segment) -- and an optional gated norm (``mamba_rms_norm``; without it the
    output is gated by silu(gate) alone)."""
    refuse_cache(module, cache_params, "SSM and conv state")
    projected = module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
    gate, y = _conv_and_scan(module, projected)
    y = module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)
    return module.out_proj(y.to(hidden_states.dtype))


PATCHES: tuple = (
    ModulePatch(
        "canonical_mamba2_mixer",
        "Trace Mamba-2 mixers (Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer) as in_proj -> "
        "torch_causal_conv1d -> torch_ssm -> gated norm -> out_proj instead of HF's chunked-scan einsums.",
        ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer"),
        mamba2_mixer_forward,
    ),
    ModulePatch(
        "canonical_falcon_h1_mixer",
        "Trace FalconH1Mixer (Mamba-2 with muP multipliers) as in_proj -> torch_causal_conv1d -> torch_ssm "
        "-> gated norm -> out_proj instead of HF's chunked-scan einsums.",
        ("FalconH1Mixer",),
        falcon_h1_mixer_forward,
    ),
)

__all__ = ["PATCHES", "mamba2_mixer_forward", "falcon_h1_mixer_forward"]
