"""Hierarchical equivalence checks: block -> layer -> full model -> export, each against a reference.

The onboarding workflow (``../shared/seeds/003``, phase 6) checks a model written with canonical ops
bottom-up against the HF implementation on the same weights and inputs, and each level must pass
before the next is worth looking at:

* **block** (MLP, attention, norm, MoE): ``check_block(reference, custom, *inputs)``;
* **layer** (a whole decoder layer; one per layer type for hybrid models): ``check_layer``;
* **model** (end-to-end logits on a small config): ``check_model``;
* **export** (``torch.export`` with dynamic batch and sequence, finite output, a second shape that
  agrees with eager): ``check_export``.

The comparison is ``rmse(actual - expected) / rmse(expected)`` (``rmse_ratio``): a few outlier
elements (a near-zero denominator, one rounding flip) do not fail it, a wrong computation does.
Blocks with identical math (an MLP of plain linears) can ask for ``identical_math=True``, which
compares element-wise with ``torch.testing.assert_close`` instead. Tolerances are the caller's; the
seed's guidance for bfloat16: identical math 1e-3 element-wise, layers and models a few 1e-2.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch


class EquivalenceError(AssertionError):
    """A level of the hierarchy failed: names the level, the ratio and the tolerance."""


def rmse_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rmse(actual - expected) / rmse(expected)`` in fp64 (0 when both are exactly equal)."""
    if actual.shape != expected.shape:
        raise EquivalenceError(f"shapes differ: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).pow(2).mean().sqrt()
    ref = e.pow(2).mean().sqrt()
    if float(ref) == 0.0:
        return 0.0 if float(err) == 0.0 else float("inf")
    return float(err / ref)


def assert_rmse_close(actual: torch.Tensor, expected: torch.Tensor, rmse_ratio_tol: float, msg: str = "") -> float:
    """Raise ``EquivalenceError`` unless ``rmse_ratio(actual, expected) <= rmse_ratio_tol``; returns the ratio.
    Non-finite values in ``actual`` fail whatever the tolerance."""
    if not torch.isfinite(actual).all():
        raise EquivalenceError(f"{msg + ': ' if msg else ''}actual has non-finite values")
    ratio = rmse_ratio(actual, expected)
    if not ratio <= rmse_ratio_tol:
        raise EquivalenceError(f"{msg + ': ' if msg else ''}rmse ratio {ratio:.3e} > tolerance {rmse_ratio_tol:.1e}")
    return ratio


def copy_weights(
    reference: torch.nn.Module,
    custom: torch.nn.Module,
    convert: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None,
) -> None:
    """Give ``custom`` the reference's weights: its state dict, through ``convert`` (key renames, stacking
    experts, de-interleaving RoPE rows...) when the layouts differ. Strict: a missing or unexpected key
    is an error naming it, never a silently random weight."""
    state = dict(reference.state_dict())
    if convert is not None:
        state = convert(state)
    result = custom.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise EquivalenceError(
            f"weights do not line up: missing in the reference's state dict "
            f"{list(result.missing_keys)[:6]}, unexpected {list(result.unexpected_keys)[:6]}; "
            "pass convert= to map the reference's keys/layouts to the custom module's"
        )


def _first(out: Any) -> torch.Tensor:
    """The tensor a module's output stands for (HF layers return tuples, models an output object)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise EquivalenceError(f"cannot tell which tensor of a {type(out).__name__} output to compare")


def _compare(
    level: str,
    reference: Callable,
    custom: Callable,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    ref_kwargs: Optional[Mapping[str, Any]],
    tol: float,
    identical_math: bool,
) -> float:
    with torch.no_grad():
        expected = _first(reference(*args, **(kwargs if ref_kwargs is None else ref_kwargs)))
        actual = _first(custom(*args, **kwargs))
    if identical_math:
        try:
            torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
        except AssertionError as e:
            raise EquivalenceError(f"{level}: not element-wise equal within {tol:.1e}: {e}") from None
        return rmse_ratio(actual, expected)
    return assert_rmse_close(actual, expected, tol, level)


def check_block(
    reference: Callable,
    custom: Callable,
    *args: Any,
    tol: float = 1e-5,
    identical_math: bool = False,
    ref_kwargs: Optional[Mapping[str, Any]] = None,
    **kwargs: Any,
) -> float:
    """Level 1: one block (MLP, attention, norm, MoE) on the same inputs; returns the rmse ratio.
    ``ref_kwargs`` when the reference takes other keyword arguments (e.g. HF attention's masks)."""
    return _compare("block", reference, custom, args, kwargs, ref_kwargs, tol, identical_math)


def check_layer(
    reference: Callable,
    custom: Callable,
    *args: Any,
    tol: float = 1e-5,
    ref_kwargs: Optional[Mapping[str, Any]] = None,
    **kwargs: Any,
) -> float:
    """Level 2: a whole decoder layer (one call per layer type of a hybrid model)."""
    return _compare("layer", reference, custom, args, kwargs, ref_kwargs, tol, False)


def check_model(
    reference: Callable, custom: Callable, input_ids: torch.Tensor, position_ids: torch.Tensor, tol: float = 1e-5
) -> float:
    """Level 3: end-to-end logits. ``reference`` is called HF-style (``input_ids=, position_ids=``),
    ``custom`` with the export contract ``(input_ids, position_ids)``."""
    with torch.no_grad():
        expected = _first(reference(input_ids=input_ids, position_ids=position_ids))
        actual = _first(custom(input_ids, position_ids))
    return assert_rmse_close(actual, expected, tol, "model")


def check_export(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    second: Optional[Sequence[int]] = None,
    tol: float = 1e-5,
    max_batch: int = 64,
    max_seq: int = 4096,
) -> torch.fx.GraphModule:
    """Level 4: ``torch.export`` with dynamic batch and sequence dims (the export contract
    ``(input_ids, position_ids) -> logits``), a finite output equal to eager, and a second
    ``[batch, seq]`` shape (default: one more of each) that runs and agrees too. Returns the module."""
    b = torch.export.Dim.DYNAMIC(min=1, max=max_batch)
    s = torch.export.Dim.DYNAMIC(min=1, max=max_seq)
    with torch.no_grad():
        ep = torch.export.export(
            model, (input_ids, position_ids), dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), strict=False
        )
    gm = ep.module()
    shapes = [tuple(input_ids.shape), tuple(second or (input_ids.shape[0] + 1, input_ids.shape[1] + 1))]
    for batch, seq in shapes:
        ids = torch.randint(
            0, int(input_ids.max()) + 1, (batch, seq), generator=torch.Generator().manual_seed(batch * 1000 + seq)
        )
        pos = torch.arange(seq).expand(batch, seq)
        with torch.no_grad():
            assert_rmse_close(_first(gm(ids, pos)), _first(model(ids, pos)), tol, f"export at shape {(batch, seq)}")
    return gm


__all__ = [
    "EquivalenceError",
    "rmse_ratio",
    "assert_rmse_close",
    "copy_weights",
    "check_block",
    "check_layer",
    "check_model",
    "check_export",
]
