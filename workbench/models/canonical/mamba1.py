"""Canonical forward of the Mamba-1 mixers (Mamba, FalconMamba, Jamba's Mamba layers).

HF's no-kernel path runs the selective scan as a Python loop over the tokens (``for index in
range(seq_len)``), which ``torch.export`` can only unroll for one concrete length: a dynamic
sequence dim is specialized away ("Constraints violated ... specialized it to be a constant").
The replacement keeps the mixer's projections and norms as plain module calls (the usual matchers
still see linears and norms) and routes the two recurrent pieces through canonical ops, each of
which the cache stage turns into a state-slot op::

    in_proj -> split [x | gate] -> act(torch_causal_conv1d) -> x_proj -> split [dt_low | B | C]
            -> (FalconMamba / Jamba: RMS norms of dt_low, B, C)
            -> dt = dt_low @ dt_proj.weight^T  (the bias goes to the op: HF adds it in fp32)
            -> torch_selective_scan(x, A=-exp(A_log), B, C, D, dt, dt_proj.bias) * silu(gate) -> out_proj

Modules are recognised by mechanism (``is_mamba1_mixer``: the Mamba-1 parameter layout and sizes),
not only by class name, so a family that reuses the layout under another name is covered; the
classes named in the patch are the ones tested. The forward runs only while ``export_to_gm`` traces
a model without cache: HF's cache object, when given, is refused (the cache stage adds the state).
A 2-D padding mask (what HF hands recurrent layers when padding) zeroes padded tokens before and
after the conv, as HF does; the export contract passes none.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...ops import conv as _conv_ops  # noqa: F401  (registers workbench::torch_causal_conv1d)
from ...ops import selective_scan as _scan_ops  # noqa: F401  (registers workbench::torch_selective_scan)
from . import ModulePatch, refuse_cache
from .conv import conv_then_activation

#: The HF classes with this layout (tested); ``is_mamba1_mixer`` also accepts others that share it.
MAMBA1_MIXER_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")
#: Optional RMS norms of (dt_low, B, C) between x_proj and the scan (FalconMamba, Jamba).
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def _layout_problems(module: Any) -> List[str]:
    """What keeps ``module`` (which has ``x_proj``, ``dt_proj`` and a 2-D ``A_log``) from being a
    Mamba-1 mixer the canonical forward can run: missing parts, then sizes that disagree."""
    parts = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "D", "time_step_rank", "ssm_state_size")
    missing = [p for p in parts if getattr(module, p, None) is None]
    if missing:
        return [f"missing {', '.join(missing)}"]
    d, n = module.A_log.shape
    rank, conv, dt_proj = module.time_step_rank, module.conv1d, module.dt_proj
    checks = (
        (module.ssm_state_size == n, f"ssm_state_size {module.ssm_state_size} != A_log's {n}"),
        (tuple(module.D.shape) == (d,), f"D {tuple(module.D.shape)} != [{d}]"),
        (
            isinstance(conv, nn.Conv1d) and tuple(conv.weight.shape[:2]) == (d, 1),
            f"conv1d is not a depthwise conv over {d} channels",
        ),
        (getattr(module.in_proj, "out_features", None) == 2 * d, f"in_proj width != x + gate = 2 * {d}"),
        (
            (getattr(module.x_proj, "in_features", None), getattr(module.x_proj, "out_features", None))
            == (d, rank + 2 * n),
            f"x_proj is not {d} -> dt rank + 2 * state = {rank} + 2 * {n}",
        ),
        (
            isinstance(dt_proj, nn.Linear) and (dt_proj.in_features, dt_proj.out_features) == (rank, d),
            f"dt_proj is not an nn.Linear {rank} -> {d}",
        ),
        (isinstance(dt_proj, nn.Linear) and dt_proj.bias is not None, "dt_proj has no bias"),
    )
    return [why for ok, why in checks if not ok]


def is_mamba1_mixer(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-1 mixer, by layout: ``x_proj`` and ``dt_proj`` next to a 2-D
    ``A_log [d, n]`` (one decay rate per channel and state entry) -- the signature -- plus a
    depthwise ``conv1d`` over d channels, ``in_proj`` to 2d (x and gate), ``x_proj`` d -> ``rank +
    2n``, ``dt_proj`` rank -> d with a bias, ``D [d]`` and ``out_proj``. Mamba-2 mixers (``A_log
    [heads]``, no ``x_proj``) lack the signature: False. A module with the signature but not the rest
    raises ``ValueError`` in one line naming its class and what is off: exporting it through HF's
    own per-token loop would fail later, less clearly."""
    a_log = getattr(module, "A_log", None)
    if not (hasattr(module, "x_proj") and hasattr(module, "dt_proj") and isinstance(a_log, torch.Tensor)):
        return False
    if a_log.dim() != 2:
        return False
    problems = _layout_problems(module)
    if problems:
        raise ValueError(
            f"{type(module).__name__} looks like a Mamba-1 mixer (x_proj, dt_proj, 2-D A_log) but "
            f"{'; '.join(problems)}: the canonical forward cannot run it (export_to_gm.patches: "
            "{canonical_mamba1_mixer: false} traces HF's own forward instead)"
        )
    return True


def _mask_padding(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Zero padded tokens ([b, s] mask); a 4-D attention mask or None leaves the input alone."""
    if attention_mask is None or attention_mask.dim() != 2:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def mamba1_mixer_forward(
    module: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    cache_params: Any = None,
    **_kwargs,
) -> torch.Tensor:
    """A Mamba-1 mixer through the canonical ops: hidden_states [b, s, hidden] -> [b, s, hidden].

    ``cache`` / ``cache_params`` (transformers 5.2x renames the latter): refused when given.
    """
    refuse_cache(module, cache if cache is not None else cache_params, "selective-scan and conv state")
    d, n = module.A_log.shape
    rank = module.time_step_rank
    dtype = hidden_states.dtype
    x, gate = module.in_proj(_mask_padding(hidden_states, attention_mask)).chunk(2, dim=-1)  # [b, s, d] each
    # The conv runs in its weight's dtype and hands back the input's, as HF's causal_conv1d_fn does;
    # casts only where they differ (a dtype is static at trace time), so fp32 graphs get none.
    weight = module.conv1d.weight
    conv = conv_then_activation(
        x if x.dtype == weight.dtype else x.to(weight.dtype), weight, module.conv1d.bias, module.activation
    )
    x = _mask_padding(conv if conv.dtype == x.dtype else conv.to(x.dtype), attention_mask)
    dt_low, B, C = module.x_proj(x).split([rank, n, n], dim=-1)
    if all(hasattr(module, norm) for norm in _NORMS):
        dt_low, B, C = module.dt_layernorm(dt_low), module.b_layernorm(B), module.c_layernorm(C)
    y = torch.ops.workbench.torch_selective_scan(
        x,
        -torch.exp(module.A_log.float()),
        B,
        C,
        module.D,
        F.linear(dt_low, module.dt_proj.weight),
        module.dt_proj.bias,
    )
    return module.out_proj((y * F.silu(gate)).to(dtype))


PATCHES: tuple = (
    ModulePatch(
        "canonical_mamba1_mixer",
        "Trace Mamba-1 mixers (MambaMixer, FalconMambaMixer, JambaMambaMixer, or any module with their layout) "
        "as in_proj -> torch_causal_conv1d -> x_proj -> torch_selective_scan * silu(gate) -> out_proj instead "
        "of HF's per-token Python loop.",
        (),  # no class names: recognised by layout alone (MAMBA1_MIXER_CLASSES are the ones tested)
        mamba1_mixer_forward,
        match=is_mamba1_mixer,
    ),
)

__all__ = ["PATCHES", "MAMBA1_MIXER_CLASSES", "is_mamba1_mixer", "mamba1_mixer_forward"]
