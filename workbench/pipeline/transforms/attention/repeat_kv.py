"""Repeated K/V (stage ``pattern_matcher``): HF's ``repeat_kv`` -> ``torch_attention_repeat_kv``, and
``torch_attention`` fed the un-repeated K/V.

* ``match_repeat_kv`` (step 1 of the attention chain, ``matchers.py``): the unsqueeze / expand /
  reshape chain that repeats each KV head ``n_rep`` times, in bnsd and in bsnd (custom code that
  keeps heads third) -> ``torch_attention_repeat_kv(x, n_rep)``.
* ``match_grouped_attention`` (step 4): ``torch_attention`` whose K/V are still repeated (our op,
  or a raw chain ``repeat_kv_source`` recognises) reads the un-repeated ones: native GQA.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import Match, Pattern, PatternMatcher, PatternTransform, match_info, named_args, same_shape
from .variants import N_REP

aten = torch.ops.aten
wb = torch.ops.workbench


def _repeat_kv(x):
    # HF repeat_kv: [b, n_kv, s, d] -> [b, n_kv * n_rep, s, d]. Traced with n_rep=3 (example 2 -> 6
    # heads); the sizes are ignored and re-derived from shapes in the check.
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, N_REP, s, d).reshape(b, n_kv * N_REP, s, d)


def _repeat_kv_replacement(x, *, n_rep):
    return wb.torch_attention_repeat_kv.default(x, n_rep)


def _repeat_check(heads_dim: int):
    """The check of a repeat whose heads are dim ``heads_dim`` of x (1: bnsd, 2: bsnd): the expand
    really repeats each KV head ``n_rep`` times (a new dim right after the heads) and the reshape
    merges exactly that."""

    def check(m: Match) -> Optional[Dict[str, Any]]:
        x = m.val("x")
        (expand,), (reshape,) = m.matched(aten.expand.default), m.matched(aten.reshape.default)
        e, r = tensor_meta(expand), tensor_meta(reshape)
        if x is None or e is None or r is None or x.dim() != 4 or e.dim() != 5:
            return None
        n_rep = e.shape[heads_dim + 1]
        if not isinstance(n_rep, int):
            return None
        shape = list(x.shape)
        repeated = shape[: heads_dim + 1] + [n_rep] + shape[heads_dim + 1 :]
        merged = shape[:heads_dim] + [shape[heads_dim] * n_rep] + shape[heads_dim + 1 :]
        if not same_shape(e.shape, repeated) or not same_shape(r.shape, merged):
            return None
        return {"n_rep": n_rep}

    return check


def _repeat_pattern(name: str, search, replacement, example_shape: Tuple[int, ...], heads_dim: int) -> Pattern:
    """A repeat of KV heads at dim ``heads_dim`` of its input (example ``example_shape``): the expand's
    and the reshape's sizes are not compared but re-derived from shapes (``_repeat_check``)."""
    return Pattern(
        name,
        search,
        replacement,
        lambda: (torch.randn(*example_shape),),
        ignore=((aten.expand.default, "size"), (aten.reshape.default, "shape")),
        check=_repeat_check(heads_dim),
    )


REPEAT_KV_PATTERN = _repeat_pattern("repeat_kv", _repeat_kv, _repeat_kv_replacement, (1, 2, 4, 8), heads_dim=1)


def _repeat_kv_bsnd(x):
    # The same repeat in the bsnd layout: [b, s, n_kv, d] -> [b, s, n_kv * n_rep, d] (custom code
    # that keeps heads third). The sizes are again re-derived in the check.
    b, s, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, n_kv, N_REP, d).reshape(b, s, n_kv * N_REP, d)


def _repeat_kv_bsnd_replacement(x, *, n_rep):
    # Our op repeats bnsd heads: around it, transposes that the bnsd attention's own transpose
    # cancels (match_grouped_attention looks through such pairs; eliminate_redundant_transposes
    # removes them).
    return aten.transpose.int(wb.torch_attention_repeat_kv.default(aten.transpose.int(x, 1, 2), n_rep), 1, 2)


REPEAT_KV_BSND_PATTERN = _repeat_pattern(
    "repeat_kv_bsnd", _repeat_kv_bsnd, _repeat_kv_bsnd_replacement, (1, 4, 2, 8), heads_dim=2
)


def _through_transpose_pairs(node: Any) -> Any:
    """``y`` for ``transpose(transpose(y, 1, 2), 1, 2)`` (repeatedly), else ``node``."""
    while (
        isinstance(node, fx.Node)
        and node.target is aten.transpose.int
        and sorted(node.args[1:3]) == [1, 2]
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is aten.transpose.int
        and sorted(node.args[0].args[1:3]) == [1, 2]
    ):
        node = node.args[0].args[0]
    return node


def repeat_kv_source(gm: fx.GraphModule, node: Any) -> Optional[Tuple[fx.Node, int]]:
    """``(x, n_rep)`` if ``node`` repeats KV heads of ``x`` (our op, or the raw HF chain), also
    behind a pair of transposes that cancel (a repeat in the bsnd layout, transposed to bnsd)."""
    node = _through_transpose_pairs(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is wb.torch_attention_repeat_kv.default:
        return node.args[0], node.args[1]
    if node.target is aten.reshape.default:
        m = PatternMatcher().match_at(gm, REPEAT_KV_PATTERN, node)
        if m is not None:
            return m.inputs["x"], m.literals["n_rep"]
    return None


@register("match_repeat_kv")
class MatchRepeatKV(PatternTransform):
    """Replace HF's repeat_kv chain (and its bsnd spelling) by ``torch_attention_repeat_kv(x, n_rep)``."""

    patterns = (REPEAT_KV_PATTERN, REPEAT_KV_BSND_PATTERN)


@register("match_grouped_attention")
class MatchGroupedAttention(Transform):
    """Feed ``torch_attention`` the un-repeated K/V wherever it still gets repeated ones.

    Catches what ``match_sdpa_to_torch_attention`` could not see, e.g. repeat_kv matched after it
    or a raw expand/reshape chain. bnsd only: that is the layout repeat_kv repeats in.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        n = 0
        for node in call_nodes(gm, wb.torch_attention.default):
            args = dict(named_args(node))
            if args["layout"] != "bnsd":
                continue
            k_src, v_src = repeat_kv_source(gm, args["key"]), repeat_kv_source(gm, args["value"])
            if k_src is None or v_src is None or k_src[1] != v_src[1]:
                continue
            node.update_arg(1, k_src[0])
            node.update_arg(2, v_src[0])
            n += 1
        if n:
            gm.graph.eliminate_dead_code()  # the repeat chains are unused now
        return match_info(gm, {"grouped_attention": n})


__all__ = ["REPEAT_KV_PATTERN", "REPEAT_KV_BSND_PATTERN", "repeat_kv_source"]
