"""The numerics probe: compare a graph's logits with the eager model's on a fixed batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class ProbeError(RuntimeError):
    """The numerics probe could not run on the graph a transform left (the stepper fails that step
    with it): a graph that cannot run the probe batch the eager model runs is not a finished step."""


@dataclass(frozen=True)
class Numerics:
    max_abs: Optional[float] = None
    rmse_ratio: Optional[float] = None  # rmse(out - ref) / rms(ref)
    top1_agreement: Optional[float] = None  # fraction of positions with the same argmax token
    error: Optional[str] = None  # why the probe could not run
    carried_from: Optional[str] = None  # the graph was unchanged: this is that earlier snapshot's result
    from_cache: bool = False  # read from the probe cache: an earlier process ran this very probe

    @property
    def ok(self) -> bool:
        return self.error is None


def compare_logits(out: torch.Tensor, ref: torch.Tensor) -> Numerics:
    if out.shape != ref.shape:
        return Numerics(error=f"logits shape {tuple(out.shape)} != eager {tuple(ref.shape)}")
    o, r = out.detach().float(), ref.detach().float()
    diff = o - r
    rms_ref = r.pow(2).mean().sqrt().clamp_min(1e-30)
    return Numerics(
        max_abs=diff.abs().max().item(),
        rmse_ratio=(diff.pow(2).mean().sqrt() / rms_ref).item(),
        top1_agreement=(o.argmax(-1) == r.argmax(-1)).float().mean().item(),
    )


def exceeds(n: Optional[Numerics], tol: float, metric: str = "rmse_ratio") -> bool:
    """Whether a probe result crosses ``tol``.

    A probe that could not run has no value to compare, so it never counts as crossing (the
    stepper fails the step whose probe could not run: such a snapshot is never recorded as done).
    """
    if n is None or not n.ok:
        return False
    value = getattr(n, metric)
    if metric == "top1_agreement":
        return value < 1.0 - tol
    return value > tol


class NumericsMoved(RuntimeError):
    """A transform that only re-spells the model's computation (a cleanup, a pattern matcher) moved
    the probe's logits beyond its tolerance: the rewrite changed the answer (the stepper fails that
    step with it, or undoes it with ``skip_on_error``)."""


# The stages whose transforms rewrite the model's own computation into other spellings of it: any
# change of the answer there beyond rounding is a wrong rewrite (quantizing transforms of these
# stages declare ``changes_numerics``).
GUARDED_STAGES = ("post_export", "pattern_matcher")


def rewrite_tolerance(dtype: torch.dtype) -> float:
    """How far a re-spelling may move the probe's rmse ratio in the model's ``dtype``: 4 units of
    its rounding (bf16 3.1e-2, fp16 3.9e-3), at least 1e-4 (fp32: summation order over many layers).
    Measured: every default matcher moves tiny llama / mixtral (fp32, bf16) by 0, gemma2's eager
    soft-capped attention in fp16 by 9.9e-4; a dropped causal mask moves them by 0.1-1."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(1e-4, 4 * eps)


def moved_beyond(prev: Optional[Numerics], now: Optional[Numerics], tol: float) -> Optional[str]:
    """How ``now`` moved from ``prev`` if its rmse ratio grew by more than ``tol``, else None (also
    when either probe is missing or failed: nothing to compare)."""
    if prev is None or now is None or not prev.ok or not now.ok:
        return None
    if prev.rmse_ratio is None or now.rmse_ratio is None or now.rmse_ratio - prev.rmse_ratio <= tol:
        return None
    return (
        f"rmse ratio against the eager model {prev.rmse_ratio:.2e} -> {now.rmse_ratio:.2e} (allowed "
        f"+{tol:.1e}), max abs {now.max_abs:.3g}, top-1 agreement {now.top1_agreement:.0%}"
    )
