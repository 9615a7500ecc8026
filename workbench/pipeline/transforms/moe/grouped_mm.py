"""What transformers' experts spellings share, for the stacked-experts patterns (``matchers.py``,
``biased_experts.py``): the ``grouped_mm`` op, the token sort around it, and the size arguments the
patterns leave to their checks.

The ``grouped_mm`` experts forward sorts the (token, slot) pairs by expert, runs one grouped GEMM per
projection over the sorted rows (``sort_by_expert``: the rows, their routing weights, the per-expert
offsets), then weights the rows, un-permutes them and sums each token's top-k (``unsort_by_expert``).
With an expert-parallel "sentinel" mask (transformers 5.17 writes it always; 5.23 only when experts
are sharded) ids >= E are zeroed and clamped: with E local experts no id reaches E, so it masks
nothing. These helpers are called from inside the patterns' ``search`` functions, so they are traced
op for op as the model spells them.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

aten = torch.ops.aten


def grouped_mm_op():
    """``torch.ops.transformers.grouped_mm_fallback``, or None while transformers' MoE integration
    is not imported (or lacks it). The op is registered when ``transformers.integrations.moe`` is
    imported, which every model whose experts use it does when it loads: a graph holding the op
    implies the module is loaded. Importing it only to look would import Dynamo (~1 s, ~140 MB)
    into every run."""
    if "transformers.integrations.moe" not in sys.modules:
        return None
    return getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)


class SortedTokens(NamedTuple):
    """The (token, slot) rows sorted by expert, as the grouped GEMMs read them."""

    expert_sorted: Any  # expert id of each sorted row (clamped in place under the sentinel mask)
    perm: Any  # sorted row -> flat (token, slot) index
    xs: Any  # the token of each sorted row
    ws: Any  # the routing weight of each sorted row
    offsets: Any  # cumulative row count per expert (int32)
    mask: Any  # [rows, 1] rows routed to a sentinel id (>= E), or None without the sentinel mask
    clamped: Any  # the in-place clamp's result (export keeps the mutation), or None


def sort_by_expert(x, selected, weights, k, n_exp: int, sentinel: bool) -> SortedTokens:
    """The start of the ``grouped_mm`` forward over ``n_exp`` experts: the (token, slot) pairs of
    ``selected`` / ``weights`` [T, k] sorted by expert, with the per-expert offsets; ``sentinel``:
    the expert-parallel mask built, the ids clamped and the masked rows of ``xs`` zeroed."""
    flat_w, flat_e = weights.reshape(-1), selected.reshape(-1)
    expert_sorted, perm = torch.sort(flat_e)
    xs, ws = x[perm // k], flat_w[perm]
    counts = torch.histc(expert_sorted.float(), bins=n_exp, min=0, max=n_exp - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    mask = clamped = None
    if sentinel:
        mask = (expert_sorted >= n_exp).unsqueeze(-1)
        clamped = expert_sorted.clamp_(max=n_exp - 1)
        xs.masked_fill_(mask, 0.0)
    return SortedTokens(expert_sorted, perm, xs, ws, offsets, mask, clamped)


def unsort_by_expert(y, rows: SortedTokens, x, k):
    """The end of the ``grouped_mm`` forward: the sorted rows ``y`` weighted, put back in (token,
    slot) order and summed over each token's ``k`` slots, in x's dtype."""
    y = y * rows.ws.unsqueeze(-1)
    inv = torch.empty_like(rows.perm)
    inv[rows.perm] = torch.arange(rows.perm.size(0))
    return y[inv].view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


# Size and device arguments the experts' spellings take from the model (expert count, token count,
# dtype): not literals to bind.
EXPERT_SIZE_ARGS = (
    (aten.view.default, "size"),
    (aten.histc.default, "bins"),
    (aten.histc.default, "min"),
    (aten.histc.default, "max"),
    (aten.arange.default, "end"),
    (aten.arange.default, "device"),
    (aten.arange.default, "pin_memory"),
    (aten.to.dtype, "dtype"),
    (aten.ge.Scalar, "other"),
    (aten.clamp_.default, "max"),
)

__all__ = ["EXPERT_SIZE_ARGS", "SortedTokens", "grouped_mm_op", "sort_by_expert", "unsort_by_expert"]
