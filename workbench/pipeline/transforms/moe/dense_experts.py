"""The dense all-experts MoE forms (stage ``pattern_matcher``) -> ``torch_moe_dense_mlp``.

* ``match_bmm_moe_pattern``: Llama-4 style, routing applied to the *input* of all-expert BMMs ->
  ``torch_moe_dense_mlp(..., apply_routing_on_input=True)``. Experts an FP8 checkpoint stores in fp8
  stay BMMs (``fp8_bmm_weights``) for ``quantize_fp8_bmm_from_config``.
* ``match_dense_moe_pattern``: the dense all-experts BMM form weighted on the output ->
  ``torch_moe_dense_mlp``. No causal LM in transformers 5.x spells its MoE this way (their experts
  use the experts interface of ``matchers.py``, loop over the hit experts, or are Llama-4's
  input-weighted BMMs).

Either form may store the gate or the up half first in its stacked projection (``up_first``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....models.quantized_checkpoint import bmm_scale_names
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import TransformInfo, register
from ...matcher import Match, Pattern, PatternMatcher, PatternTransform, match_info

aten = torch.ops.aten
wb = torch.ops.workbench

# Example sizes for tracing: T tokens, H hidden, I intermediate, E experts.
_T, _H, _I, _E = 5, 8, 6, 7


def _dense_examples():
    return (torch.randn(_T, _H), torch.rand(_T, _E), torch.randn(_E, _H, 2 * _I), torch.randn(_E, _I, _H))


def _halves(h, up_first: bool):
    # (gate, up) of the stacked projection's output: HF writes ``gate, up = h.chunk(2)``; other
    # model code stores the up rows first (``up, gate = h.chunk(2)``).
    first, second = h.chunk(2, dim=-1)
    return (second, first) if up_first else (first, second)


def _bmm_moe_routed_input(up_first: bool):
    def search(x, scores, gate_up, down):
        # Llama-4 TextMoe + TextExperts: every expert sees every token, pre-scaled by its score.
        n_exp = gate_up.shape[0]
        routed = x.repeat(n_exp, 1) * scores.transpose(0, 1).reshape(-1, 1)
        h = torch.bmm(routed.view(n_exp, -1, x.shape[-1]), gate_up)
        gate, up = _halves(h, up_first)
        y = torch.bmm(up * F.silu(gate), down).view(-1, x.shape[-1])
        return y.reshape(n_exp, -1, x.shape[-1]).sum(dim=0)

    return search


def _dense_moe(up_first: bool):
    def search(x, scores, gate_up, down):
        # The dense all-experts form weighted on the output (e.g. older gpt-oss CPU experts).
        n_exp = gate_up.shape[0]
        h = torch.bmm(x.repeat(n_exp, 1).view(n_exp, -1, x.shape[-1]), gate_up)
        gate, up = _halves(h, up_first)
        y = torch.bmm(F.silu(gate) * up, down)
        y = y * scores.transpose(0, 1).reshape(n_exp, -1)[..., None]
        return y.sum(dim=0)

    return search


def _dense_replacement(on_input: bool, up_first: bool):
    def replacement(x, scores, gate_up, down):
        # Weights are stored [E, in, out]; the op takes nn.Linear layout [E, out, in] (views).
        w13 = aten.transpose.int(gate_up, 1, 2)
        w2 = aten.transpose.int(down, 1, 2)
        flags = {"up_first": True} if up_first else {}
        return wb.torch_moe_dense_mlp.default(x, scores, w13, w2, apply_routing_on_input=on_input, **flags)

    return replacement


def _dense_check(m: Match) -> Optional[Dict[str, Any]]:
    """x [T, H], scores [T, E], gate_up [E, H, 2I], down [E, I, H]; reshapes split/merge E."""
    x, s, gu, dn = (m.val(n) for n in ("x", "scores", "gate_up", "down"))
    if any(t is None for t in (x, s, gu, dn)) or x.dim() != 2 or s.dim() != 2 or gu.dim() != 3:
        return None
    n_exp, hidden, two_i = gu.shape
    if s.shape[-1] != n_exp or tuple(dn.shape) != (n_exp, two_i // 2, hidden):
        return None
    for r in m.matched(aten.repeat.default):
        if list(r.args[1]) != [n_exp, 1]:
            return None
    for v in m.matched(aten.view.default) + m.matched(aten.reshape.default):
        out = tensor_meta(v)
        if out is None or (out.dim() == 3 and out.shape[0] != n_exp):
            return None
    return {}


_DENSE_IGNORE = ((aten.repeat.default, "repeats"), (aten.view.default, "size"), (aten.reshape.default, "shape"))


def _dense_patterns(name: str, search_of, on_input: bool) -> Tuple[Pattern, ...]:
    """The patterns of one dense form, in either order of the gate and up halves."""
    return tuple(
        Pattern(
            f"{name}{'_up_first' if up_first else ''}",
            search_of(up_first),
            _dense_replacement(on_input, up_first),
            _dense_examples,
            ignore=_DENSE_IGNORE,
            check=_dense_check,
        )
        for up_first in (False, True)
    )


BMM_MOE_PATTERNS = _dense_patterns("bmm_moe_routed_input", _bmm_moe_routed_input, on_input=True)
DENSE_MOE_PATTERNS = _dense_patterns("dense_moe", _dense_moe, on_input=False)


def fp8_bmm_weights(gm: fx.GraphModule, ctx: PipelineContext) -> Set[str]:
    """Graph targets of the stacked weights the checkpoint stores in FP8 for ``bmm`` (``p`` in
    float8_e4m3fn with ``p_weight_scale`` / ``p_input_scale``: ModelOpt's Llama-4 experts)."""
    ck = getattr(ctx, "checkpoint", None)
    if ck is None:
        return set()
    out = set()
    for bmm in call_nodes(gm, aten.bmm.default):
        node = bmm.args[1]
        if not isinstance(node, fx.Node) or node.op != "get_attr":
            continue
        name = ck.checkpoint_name(str(node.target))
        w = ck.tensors.get(name)
        if w is not None and w.dtype == torch.float8_e4m3fn and all(s in ck for s in bmm_scale_names(name)):
            out.add(str(node.target))
    return out


def _not_reading(targets: Set[str], check):
    def guarded(m: Match) -> Optional[Dict[str, Any]]:
        for name in ("gate_up", "down"):
            node = m.inputs.get(name)
            if isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target) in targets:
                return None
        return check(m) if check is not None else {}

    return guarded


@register("match_bmm_moe_pattern")
class MatchBmmMoePattern(PatternTransform):
    """Replace Llama-4 style BMM MoE (routing scales the input) by ``torch_moe_dense_mlp``.

    Experts an FP8 checkpoint stores in fp8 (with per-tensor scales) stay BMMs: the dense MoE op
    has no FP8 form, and ``quantize_fp8_bmm_from_config`` turns those BMMs into ``torch_fp8_bmm``
    (``details["left_fp8"]`` names them)."""

    patterns = BMM_MOE_PATTERNS

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        fp8 = fp8_bmm_weights(gm, ctx)
        if not fp8:
            return super()._apply(gm, ctx)
        patterns = [dataclasses.replace(p, check=_not_reading(fp8, p.check)) for p in self.patterns]
        return match_info(gm, PatternMatcher(patterns).apply(gm), left_fp8=sorted(fp8))


@register("match_dense_moe_pattern")
class MatchDenseMoePattern(PatternTransform):
    """Replace the dense all-experts BMM MoE (weighted on the output) by ``torch_moe_dense_mlp``."""

    patterns = DENSE_MOE_PATTERNS


__all__ = ["BMM_MOE_PATTERNS", "DENSE_MOE_PATTERNS", "fp8_bmm_weights"]
