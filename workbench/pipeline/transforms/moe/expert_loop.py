"""The MoE written as a loop over experts -> ``torch_moe`` (``match_moe_pattern``).

Mixtral's classic sparse block (transformers < 5, and much custom and remote code) routes with
softmax -> top-k -> renormalise, builds ``mask = one_hot(selected, E).permute(2, 1, 0)`` [E, k, T]
and runs every expert on the tokens that chose it::

    out = zeros(T, H)
    for e in range(E):
        idx, top_x = torch.where(mask[e])
        y = experts[e](x[None, top_x].reshape(-1, H)) * weights[top_x, idx, None]
        out.index_add_(0, top_x, y.to(x.dtype))

Export unrolls the loop: E copies of one step, each an in-place ``index_add_`` into the result of
the previous one. ``EXPERT_STEP`` matches one step (a gated SwiGLU expert of three ``linear``s,
``w2(silu(w1 x) * w3 x)``); ``replace_expert_loops`` then takes a whole chain -- the steps of
experts 0..E-1, each once, from one ``zeros`` accumulator, one mask, one ``x`` and one set of
weights -- and puts one ``torch_moe(x, selected, weights, [w1_e], [w2_e], [w3_e])`` in its place.
A chain that is anything less (an expert missing or twice, another mask, an accumulator read in
between) is left as it is.

``torch_moe`` adds each token's k expert outputs in slot order, the loop in expert order: with
k = 2 the same sum (fp addition is commutative); with k > 2 the last bits may differ.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...graph.utils import tensor_meta
from ...matcher import Match, Pattern, PatternMatcher, annotate_new_nodes, same_shape

aten = torch.ops.aten
wb = torch.ops.workbench

_T, _H, _I, _E, _K = 5, 8, 6, 7, 3
_EXPERT = 5  # sentinel: the expert index selected from the mask


def _expert_step(acc, mask, x, weights, w1, w2, w3, *, e):
    idx, top_x = torch.where(mask[e])
    cur = x[None, top_x].reshape(-1, x.shape[-1])
    y = F.linear(F.silu(F.linear(cur, w1)) * F.linear(cur, w3), w2) * weights[top_x, idx, None]
    return acc.index_add_(0, top_x, y.to(x.dtype))


def _examples():
    selected = torch.stack([torch.randperm(_E)[:_K] for _ in range(_T)])
    mask = F.one_hot(selected, _E).permute(2, 1, 0)
    return (
        torch.zeros(_T, _H),
        mask,
        torch.randn(_T, _H),
        torch.rand(_T, _K),
        torch.randn(_I, _H),
        torch.randn(_H, _I),
        torch.randn(_I, _H),
    )


def _step_check(m: Match) -> Optional[Dict[str, Any]]:
    """x [T, H], weights [T, k], mask [E, k, T]; the expert weights [I, H], [H, I], [I, H]; the
    cast goes back to x's dtype and the reshape to [-1, H]."""
    x, mask, w = m.val("x"), m.val("mask"), m.val("weights")
    w1, w2, w3 = m.val("w1"), m.val("w2"), m.val("w3")
    if any(t is None for t in (x, mask, w, w1, w2, w3)) or x.dim() != 2 or mask.dim() != 3 or w.dim() != 2:
        return None
    hidden = x.shape[-1]
    if not same_shape(w1.shape, w3.shape) or w1.dim() != 2 or not same_shape(w2.shape, (hidden, w1.shape[0])):
        return None
    if not same_shape(w1.shape[1:], (hidden,)):
        return None
    (cast,) = m.matched(aten.to.dtype)
    if cast.args[1] != x.dtype:
        return None
    (reshape,) = m.matched(aten.reshape.default)
    if list(reshape.args[1]) != [-1, hidden]:
        return None
    return {}


EXPERT_STEP = Pattern(
    "moe_expert_loop_step",
    _expert_step,
    lambda *args, **kw: None,  # never used: replace_expert_loops rewrites whole chains
    _examples,
    literals={"e": _EXPERT},
    ignore=((aten.to.dtype, "dtype"), (aten.reshape.default, "shape")),
    check=_step_check,
    inputs=("acc", "mask", "x", "weights", "w1", "w2", "w3"),
)


def _one_hot_source(mask: fx.Node) -> Optional[fx.Node]:
    """``selected`` for ``mask = one_hot(selected, E).permute(2, 1, 0)``, else None."""
    if mask.target is not aten.permute.default or list(mask.args[1]) != [2, 1, 0]:
        return None
    one_hot = mask.args[0]
    if not isinstance(one_hot, fx.Node) or one_hot.target is not aten.one_hot.default:
        return None
    return one_hot.args[0]


def _chain(matcher: PatternMatcher, gm: fx.GraphModule, first: Match) -> List[Match]:
    """The steps that follow ``first`` (each one's accumulator the previous ``index_add_``,
    read by nothing else), in graph order."""
    steps = [first]
    while True:
        node = steps[-1].outputs[0]
        users = list(node.users)
        if len(users) != 1 or users[0].target is not aten.index_add_.default:
            return steps
        nxt = matcher.match_at(gm, EXPERT_STEP, users[0])
        if nxt is None or nxt.inputs["acc"] is not node:
            return steps
        steps.append(nxt)


def _replaceable(steps: List[Match]) -> Optional[fx.Node]:
    """``selected`` when ``steps`` is a whole expert loop, else None."""
    first = steps[0]
    acc = first.inputs["acc"]
    if acc.target is not aten.zeros.default or len(acc.users) != 1:
        return None
    shared = ("mask", "x", "weights")
    if any(s.inputs[name] is not first.inputs[name] for s in steps for name in shared):
        return None
    selected = _one_hot_source(first.inputs["mask"])
    if selected is None:
        return None
    n_exp = first.inputs["mask"].args[0].args[1]
    if sorted(s.literals["e"] for s in steps) != list(range(n_exp)):
        return None
    x, acc_val = tensor_meta(first.inputs["x"]), tensor_meta(acc)
    if x is None or acc_val is None or acc_val.dtype != x.dtype or not same_shape(acc_val.shape, x.shape):
        return None
    return selected


def replace_expert_loops(gm: fx.GraphModule) -> int:
    """Replace every whole expert loop in ``gm`` by one ``torch_moe``; returns how many."""
    matcher, n = PatternMatcher(), 0
    for node in [x for x in gm.graph.nodes if x.target is aten.index_add_.default]:
        if node._erased:
            continue
        first = matcher.match_at(gm, EXPERT_STEP, node)
        if first is None or first.inputs["acc"].target is not aten.zeros.default:
            continue
        steps = _chain(matcher, gm, first)
        selected = _replaceable(steps)
        if selected is None:
            continue
        by_expert = sorted(steps, key=lambda s: s.literals["e"])
        last = steps[-1].outputs[0]
        with gm.graph.inserting_before(last):
            new = gm.graph.call_function(
                wb.torch_moe.default,
                (
                    first.inputs["x"],
                    selected,
                    first.inputs["weights"],
                    [s.inputs["w1"] for s in by_expert],
                    [s.inputs["w2"] for s in by_expert],
                    [s.inputs["w3"] for s in by_expert],
                ),
            )
        last.replace_all_uses_with(new)
        order = {g: i for i, g in enumerate(gm.graph.nodes)}
        step_nodes = sorted({g for s in steps for g in s.graph_nodes}, key=order.__getitem__, reverse=True)
        annotate_new_nodes(gm, [new], [g.name for g in step_nodes], anchor=last)
        for g in step_nodes:  # users first; by hand: the in-place index_add_ nodes look impure
            if not g.users:
                gm.graph.erase_node(g)
        n += 1
    if n:
        gm.graph.eliminate_dead_code()  # the accumulators and masks, once for every loop replaced
    return n


__all__ = ["EXPERT_STEP", "replace_expert_loops"]
