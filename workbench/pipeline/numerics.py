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
