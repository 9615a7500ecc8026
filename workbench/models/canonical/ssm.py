"""Canonical forwards of the Mamba-2 mixers, recognised by mechanism rather than by class name.

HF's no-kernel path (``torch_forward`` / the ``mamba2_chunk_scan`` fallback) spells the SSD scan as
padding to whole chunks, segment sums and half a dozen einsums: hundreds of nodes, different in
every family and version, which the cache stage cannot give a state. The replacement keeps every
mixer's surroundings as plain module calls (``in_proj``, the gated ``norm``, ``out_proj``: the usual
matchers still see linears and norms) and routes the two recurrent pieces through canonical ops,
each of which the cache stage turns into a state-slot op::

    in_proj -> split [gate | x,B,C | dt] -> silu(torch_causal_conv1d) -> split [x | B | C]
            -> torch_ssm(x, A=-exp(A_log), B, C, D, dt, dt_bias) -> norm(y, gate) -> out_proj

Recognition. The same mixer lives under many class names (``Mamba2Mixer``, ``BambaMixer``,
``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer``, ``Zamba2MambaMixer``, ``FalconH1Mixer``,
...), all built the same way, so a module is a Mamba-2 mixer by its structure (``MAMBA2_SIGNATURE``:
per-head ``A_log`` and ``dt_bias``, a depthwise ``conv1d`` fed by one fused ``in_proj``). Gated
delta-rule layers share A_log / dt_bias / conv1d but project their inputs separately
(``in_proj_qkvz``, ``in_proj_qkv`` + ``in_proj_z`` ...): they are not Mamba-2 and stay the delta-rule
patches'. A module with the signature must then hold everything the forward reads
(``mamba2_mismatches``): the submodules, [heads]-shaped ``A_log`` / ``D`` / ``dt_bias``, the size
fields, and sizes that agree with the weights (in_proj's width is exactly gate + conv + dt). One that
does not is refused at export with one line naming its class and what is off -- never traced through
HF's einsums, whose graph no cache transform recognises. The muP variant (Falcon-H1: ``mup_vector``)
is its own patch, since its forward scales in_proj's input and output.

These forwards run only while ``export_to_gm`` traces a model without cache: HF's cache object,
when given, is refused (the cache stage adds the state), and the padding mask is ignored -- the
export contract has none, and the runtime never pads (HF only zeroes padded tokens with it).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ...ops import conv as _conv_ops  # noqa: F401  (registers workbench::torch_causal_conv1d)
from ...ops import ssm as _ssm_ops  # noqa: F401  (registers workbench::torch_ssm)
from ...ops.conv.causal_conv import ACTIVATIONS
from . import ModulePatch, refuse_cache
from .conv import conv_then_activation

#: What makes a module look like a Mamba-2 mixer: per-head decay and step bias, a conv, one fused in_proj.
MAMBA2_SIGNATURE: Tuple[str, ...] = ("A_log", "dt_bias", "conv1d", "in_proj")
#: Submodules the forward calls (``norm`` as ``norm(y, gate)``; the conv only lends its weights).
_SUBMODULES: Tuple[str, ...] = ("in_proj", "conv1d", "norm", "out_proj")
#: Per-head parameters, each [num_heads].
_HEAD_PARAMS: Tuple[str, ...] = ("A_log", "D", "dt_bias")
#: Integer size fields the forward splits and reshapes by.
_SIZES: Tuple[str, ...] = (
    "num_heads",
    "head_dim",
    "n_groups",
    "ssm_state_size",
    "intermediate_size",
    "conv_dim",
    "chunk_size",
)
#: The muP variant's extra fields (Falcon-H1).
_MUP_FIELDS: Tuple[str, ...] = ("mup_vector", "ssm_in_multiplier", "mamba_rms_norm")


def looks_like_mamba2(module: torch.nn.Module) -> bool:
    """True when ``module`` carries the Mamba-2 signature (``MAMBA2_SIGNATURE``), complete or not."""
    return all(getattr(module, name, None) is not None for name in MAMBA2_SIGNATURE)


def _is_mup(module: torch.nn.Module) -> bool:
    return getattr(module, "mup_vector", None) is not None


def _takes_gate(norm: Any) -> bool:
    """Whether ``norm(y, gate)`` is a valid call (HF's gated norms: ``forward(hidden_states, gate=None)``)."""
    try:
        inspect.signature(norm.forward if isinstance(norm, torch.nn.Module) else norm).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def _width(linear: Any) -> Optional[int]:
    weight = getattr(linear, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def mamba2_mismatches(module: torch.nn.Module, gated_norm: bool = True) -> List[str]:
    """What keeps the canonical forward from running ``module`` (empty: nothing). Checks presence
    first (a later check needs the sizes), then that sizes and weights agree. ``gated_norm=False``
    (Falcon-H1 without its norm) accepts a ``norm`` that takes no gate."""
    missing = [
        n for n in (*_SUBMODULES, *_HEAD_PARAMS, *_SIZES, "time_step_limit", "activation") if not hasattr(module, n)
    ]
    if missing:
        return [f"missing {', '.join(missing)}"]
    off: List[str] = []
    sizes = {n: getattr(module, n) for n in _SIZES}
    not_int = [n for n, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if not_int:
        return [f"size fields not positive ints: {', '.join(not_int)}"]
    h, d, g, n = sizes["num_heads"], sizes["head_dim"], sizes["n_groups"], sizes["ssm_state_size"]
    inner, conv_dim = sizes["intermediate_size"], sizes["conv_dim"]
    if inner != h * d:
        off.append(f"intermediate_size {inner} != num_heads * head_dim = {h * d}")
    if h % g:
        off.append(f"num_heads {h} not a multiple of n_groups {g}")
    if conv_dim != inner + 2 * g * n:
        off.append(f"conv_dim {conv_dim} != intermediate_size + 2 * n_groups * ssm_state_size = {inner + 2 * g * n}")
    for name in _HEAD_PARAMS:
        t = getattr(module, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (h,):
            off.append(
                f"{name} {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} not [num_heads] = [{h}]"
            )
    width = _width(module.in_proj)
    if width != inner + conv_dim + h:
        off.append(f"in_proj width {width} != gate + conv + dt = {inner} + {conv_dim} + {h}")
    conv_w = getattr(module.conv1d, "weight", None)
    if not isinstance(conv_w, torch.Tensor) or conv_w.dim() != 3 or tuple(conv_w.shape[:2]) != (conv_dim, 1):
        shape = tuple(conv_w.shape) if isinstance(conv_w, torch.Tensor) else None
        off.append(f"conv1d weight {shape} not depthwise [conv_dim, 1, k] = [{conv_dim}, 1, k]")
    limit = module.time_step_limit
    if not (isinstance(limit, (tuple, list)) and len(limit) == 2 and all(isinstance(v, (int, float)) for v in limit)):
        off.append(f"time_step_limit {limit!r} not a (min, max) pair")
    if module.activation not in ACTIVATIONS or module.activation is None:
        off.append(f"conv activation {module.activation!r} not one of {sorted(a for a in ACTIVATIONS if a)}")
    if gated_norm and not _takes_gate(module.norm):
        off.append(f"norm ({type(module.norm).__name__}) takes no gate")
    return off


def _refuse(module: torch.nn.Module, off: List[str], patch: str) -> None:
    raise ValueError(
        f"{type(module).__name__} looks like a Mamba-2 mixer ({', '.join(MAMBA2_SIGNATURE)}) but the canonical "
        f"forward cannot run it: {'; '.join(off)} (export_to_gm.patches: {{{patch}: false}} exports HF's own "
        "chunked scan, which the cache stage cannot give a state)"
    )


def is_mamba2_mixer(module: torch.nn.Module) -> bool:
    """``canonical_mamba2_mixer``'s predicate: a complete Mamba-2 mixer without muP multipliers.
    Raises ``ValueError`` (one line) for an incomplete one."""
    if not looks_like_mamba2(module) or _is_mup(module):
        return False
    off = mamba2_mismatches(module)
    if off:
        _refuse(module, off, "canonical_mamba2_mixer")
    return True


def is_mup_mamba2_mixer(module: torch.nn.Module) -> bool:
    """``canonical_falcon_h1_mixer``'s predicate: a complete Mamba-2 mixer with Falcon-H1's muP fields
    (``mup_vector`` over in_proj's width, ``ssm_in_multiplier``, ``mamba_rms_norm``). Raises for an
    incomplete one."""
    if not looks_like_mamba2(module) or not _is_mup(module):
        return False
    missing = [n for n in _MUP_FIELDS if not hasattr(module, n)]
    off = [f"missing {', '.join(missing)}"] if missing else []
    off += mamba2_mismatches(module, gated_norm=bool(getattr(module, "mamba_rms_norm", True)))
    width, mup = _width(module.in_proj), module.mup_vector
    if not off and (not isinstance(mup, torch.Tensor) or mup.shape[-1] != width):
        shape = tuple(mup.shape) if isinstance(mup, torch.Tensor) else type(mup).__name__
        off.append(f"mup_vector {shape} not over in_proj's width {width}")
    if off:
        _refuse(module, off, "canonical_falcon_h1_mixer")
    return True


def mamba2_mixers(model: torch.nn.Module) -> List[Any]:
    """Every complete Mamba-2 mixer of ``model`` (muP or not), whatever its class; never raises."""
    out = []
    for m in model.modules():
        if looks_like_mamba2(m):
            mup = _is_mup(m)
            if not mamba2_mismatches(m, gated_norm=not mup or bool(getattr(m, "mamba_rms_norm", True))):
                out.append(m)
    return out


def _time_step_limits(module: Any) -> Tuple[float, Optional[float]]:
    """HF's ``time_step_limit`` (min, max) as the op's options; an infinite max is ``None``."""
    low, high = module.time_step_limit
    return float(low), (None if math.isinf(high) else float(high))


def _conv_and_scan(module: Any, projected: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The mixer's core from its in_proj output [b, s, P]: returns (gate [b, s, I], y [b, s, I]).

    Shared by every Mamba-2 mixer: ``mamba2_mismatches`` guarantees the size fields
    (``intermediate_size``, ``conv_dim``, ``num_heads``, ``head_dim``, ``n_groups``, ``ssm_state_size``)
    and conv1d, A_log, D, dt_bias agree with each other.
    """
    heads, head_dim = module.num_heads, module.head_dim
    groups, state = module.n_groups, module.ssm_state_size
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    # The conv runs in its weight's dtype and hands back the input's, as HF's causal_conv1d_fn does:
    # they differ when a float32 buffer (Falcon-H1's mup_vector in a bf16 model) promoted in_proj's
    # output. Casts only then (a dtype is static at trace time), so fp32 graphs get no cast nodes.
    weight = module.conv1d.weight
    conv_in = xbc if xbc.dtype == weight.dtype else xbc.to(weight.dtype)
    conv_out = conv_then_activation(conv_in, weight, module.conv1d.bias, module.activation)
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


def mamba2_mixer_forward(
    module: Any, hidden_states: torch.Tensor, cache=None, *_args, cache_params=None, **_kwargs
) -> torch.Tensor:
    """A Mamba-2 mixer (``is_mamba2_mixer``): hidden_states [b, s, hidden] -> [b, s, hidden]. The
    gated norm multiplies by silu(gate) before normalizing (HF's ``MambaRMSNormGated`` and its
    per-group kin, run as the module itself). ``cache`` / ``cache_params``: HF's cache (the name
    changed in transformers 5.2x), refused."""
    refuse_cache(module, cache if cache is not None else cache_params, "SSM and conv state")
    gate, y = _conv_and_scan(module, module.in_proj(hidden_states))
    return module.out_proj(module.norm(y, gate).to(hidden_states.dtype))


def falcon_h1_mixer_forward(
    module: Any, hidden_states: torch.Tensor, cache=None, *_args, cache_params=None, **_kwargs
) -> torch.Tensor:
    """A Mamba-2 mixer with muP multipliers (``is_mup_mamba2_mixer``, Falcon-H1) -- the input scaled
    by ``ssm_in_multiplier``, the in_proj output by the per-channel ``mup_vector`` (one factor per
    gate / x / B / C / dt segment) -- and an optional gated norm (``mamba_rms_norm``; without it the
    output is gated by silu(gate) alone)."""
    refuse_cache(module, cache if cache is not None else cache_params, "SSM and conv state")
    projected = module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
    gate, y = _conv_and_scan(module, projected)
    y = module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)
    return module.out_proj(y.to(hidden_states.dtype))


PATCHES: tuple = (
    ModulePatch(
        "canonical_mamba2_mixer",
        "Trace Mamba-2 mixers -- recognised by structure (A_log, dt_bias, conv1d, one fused in_proj): "
        "Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer, GraniteMoeHybridMambaLayer, Zamba2MambaMixer, ... -- "
        "as in_proj -> torch_causal_conv1d -> torch_ssm -> gated norm -> out_proj instead of HF's "
        "chunked-scan einsums; an incomplete look-alike is refused.",
        (),
        mamba2_mixer_forward,
        match=is_mamba2_mixer,
    ),
    ModulePatch(
        "canonical_falcon_h1_mixer",
        "Trace Mamba-2 mixers with muP multipliers (mup_vector: FalconH1Mixer) as in_proj -> "
        "torch_causal_conv1d -> torch_ssm -> gated norm -> out_proj instead of HF's chunked-scan einsums.",
        (),
        falcon_h1_mixer_forward,
        match=is_mup_mamba2_mixer,
    ),
)

__all__ = [
    "PATCHES",
    "MAMBA2_SIGNATURE",
    "looks_like_mamba2",
    "mamba2_mismatches",
    "mamba2_mixers",
    "is_mamba2_mixer",
    "is_mup_mamba2_mixer",
    "mamba2_mixer_forward",
    "falcon_h1_mixer_forward",
]
