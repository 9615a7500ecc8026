"""``match_moe_routing_pattern`` (stage ``pattern_matcher``): the router's softmax -> top-k ->
renormalise -> one routing op (``torch_moe_topk_softmax``, or the Triton kernel's op).

The softmax runs in fp32 (a cast first, or softmax's own dtype); the renormalisation is in place,
out of place, or absent. The router's gate linear stays outside, as the MoE op's inputs do.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import Match, Pattern, PatternMatcher, match_info

aten = torch.ops.aten
wb = torch.ops.workbench

# Example sizes (and the top-k sentinel) for tracing: T tokens, E experts, k.
_T, _E, _K = 5, 7, 3


def _routing(softmax_cast: str, renorm: str):
    """softmax (fp32 via a cast or softmax's dtype) -> top-k -> renormalise (in place, out of place,
    or not at all) -> (weights, indices)."""

    def search(logits, *, k):
        if softmax_cast == "cast":
            probs = F.softmax(logits.to(torch.float32), dim=-1)
        else:
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, k, dim=-1)
        if renorm == "inplace":
            weights /= weights.sum(dim=-1, keepdim=True)
        elif renorm == "div":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices

    return search


class MatchMoeRoutingPatternConfig(TransformConfig):
    backend: Literal["torch", "triton"] = Field(
        default="torch",
        description="Op to emit: 'torch' (torch_moe_topk_softmax, the canonical reference) or "
        "'triton' (triton_moe_topk_softmax: the fused Triton kernel where it can run, CUDA or "
        "TRITON_INTERPRET=1, else the same torch code).",
    )


def _routing_patterns(backend: str) -> List[Pattern]:
    op = wb.triton_moe_topk_softmax.default if backend == "triton" else wb.torch_moe_topk_softmax.default
    out = []
    for renorm in ("inplace", "div", "none"):
        for cast in ("cast", "dtype"):

            def replacement(logits, *, k, _renorm=renorm != "none"):
                res = op(logits, k, _renorm)
                return res[0], res[1]

            out.append(
                Pattern(
                    f"routing_{cast}_{renorm}_{backend}",
                    _routing(cast, renorm),
                    replacement,
                    lambda: (torch.randn(_T, _E),),
                    literals={"k": _K},
                    ignore=((aten.to.dtype, "dtype"),) if cast == "cast" else (),
                    check=_routing_check(cast),
                )
            )
    return out


def _routing_check(cast: str):
    def check(m: Match) -> Optional[Dict[str, Any]]:
        logits = m.val("logits")
        if logits is None or not logits.dtype.is_floating_point:
            return None
        if cast == "cast" and any(c.args[1] != torch.float32 for c in m.matched(aten.to.dtype)):
            return None
        return {}

    return check


ROUTING_PATTERNS = {b: tuple(_routing_patterns(b)) for b in ("torch", "triton")}


@register("match_moe_routing_pattern")
class MatchMoeRoutingPattern(Transform[MatchMoeRoutingPatternConfig]):
    """Replace softmax -> top-k -> renormalize by one routing op (torch reference or Triton)."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return match_info(gm, PatternMatcher(ROUTING_PATTERNS[self.config.backend]).apply(gm))


__all__ = ["ROUTING_PATTERNS"]
