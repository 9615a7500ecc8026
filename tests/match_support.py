"""The pattern matcher itself (literals, commutativity, shared casts, outside users), plus the
helpers the test_match_* files share: run one transform on an exported module and check it."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx

from workbench.pipeline.graph.utils import op_histogram
from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages, TransformInfo
from workbench.pipeline.matcher import (
    Pattern, PatternMatcher, automatic_dims, export_graph_module, traced_pattern,
)

wb = torch.ops.workbench


# ------------------------------------------------------------------------------ shared helpers


def export(fn: Any, args: Sequence[torch.Tensor], dynamic: Optional[Dict[int, Dict[int, str]]] = None):
    """Export ``fn`` (function or module) with the given dims dynamic: {arg index: {dim: name}}."""
    dims: Dict[str, torch.export.Dim] = {}
    spec = None
    if dynamic:
        spec = tuple(
            {d: dims.setdefault(name, torch.export.Dim(name, min=2, max=64)) for d, name in dynamic.get(i, {}).items()}
            or None
            for i in range(len(args))
        )
    return export_graph_module(fn, args, dynamic_shapes=spec)


def run(key: str, gm: fx.GraphModule, **fields) -> tuple[fx.GraphModule, TransformInfo]:
    """Run one registered transform as the pipeline does (cleanup/shape flags included)."""
    cls = TRANSFORMS.get(key)
    cfg = cls.config_class(stage=Stages.PATTERN_MATCHER, **fields)
    out, info, _ = cls(cfg)(gm, None, GraphState(is_clean=True, has_valid_shapes=True))
    return out, info


def check(
    key: str,
    fn: Any,
    args: Sequence[torch.Tensor],
    *,
    matches: int,
    dynamic: Optional[Dict[int, Dict[int, str]]] = None,
    other_args: Optional[Sequence[torch.Tensor]] = None,
    atol: float = 1e-6,
    **fields,
) -> fx.GraphModule:
    """Export ``fn``, run transform ``key``: ``matches`` matches, same numbers as before at the
    example and at ``other_args`` (another shape), and the result still exports. With
    ``matches=0`` the graph must be unchanged."""
    gm = export(fn, args, dynamic)
    before_code = gm.code
    refs = [gm(*a) for a in (args, other_args) if a is not None]
    out, info = run(key, gm, **fields)
    assert info.num_matches == matches, (info, out.graph)
    if matches == 0:
        assert out.code == before_code
    for a, ref in zip([x for x in (args, other_args) if x is not None], refs):
        torch.testing.assert_close(out(*a), ref, atol=atol, rtol=atol)
    spec = None
    if dynamic:
        dims: Dict[str, Any] = {}
        spec = tuple(
            {d: dims.setdefault(n, torch.export.Dim(n, min=2, max=64)) for d, n in dynamic.get(i, {}).items()}
            or None
            for i in range(len(args))
        )
    torch.export.export(out, tuple(args), dynamic_shapes=automatic_dims(spec), strict=False)  # still exports
    return out


def count(gm: torch.nn.Module, op_name: str) -> int:
    return op_histogram(gm).get(op_name, 0)


# ------------------------------------------------------------------------------ matcher tests


def _scaled_sum(a, b, *, alpha):
    return (a + b) * alpha


def _scaled_sum_replacement(a, b, *, alpha):
    return torch.ops.aten.mul.Tensor(torch.ops.aten.add.Tensor(b, a), alpha)  # swapped on purpose


SCALED_SUM = Pattern(
    "scaled_sum", _scaled_sum, _scaled_sum_replacement, lambda: (torch.randn(3), torch.randn(3)),
    literals={"alpha": 0.37},
)


def test_literal_wildcards_bind_per_match_and_commutative_args_match_both_orders():
    def f(x, y):
        return (x + y) * 2.0 + 3.0 * (y + x) * 1.0 - (x + y) * 5.0

    gm = export(f, (torch.randn(4), torch.randn(4)))
    ref = gm(torch.ones(4), torch.arange(4.0))
    counts = PatternMatcher([SCALED_SUM]).apply(gm)
    gm.recompile()
    # (x+y)*2.0, (y+x)*3.0 (export spells 3.0*t as mul(t, 3.0); add in the other order) and (x+y)*5.0
    assert counts["scaled_sum"] == 3
    torch.testing.assert_close(gm(torch.ones(4), torch.arange(4.0)), ref)
    alphas = sorted(n.args[1] for n in gm.graph.nodes if n.meta.get("wb_replaces") and n.target is torch.ops.aten.mul.Tensor)
    assert alphas == [2.0, 3.0, 5.0]


def test_inner_nodes_used_outside_block_the_match():
    def f(x, y):
        s = x + y
        return s * 2.0, s  # the sum is needed anyway: replacing the product would duplicate it

    gm = export(f, (torch.randn(4), torch.randn(4)))
    assert PatternMatcher([SCALED_SUM]).apply(gm)["scaled_sum"] == 0


def test_traced_pattern_is_cached_and_names_inputs():
    g1, g2 = traced_pattern(SCALED_SUM), traced_pattern(SCALED_SUM)
    assert g1 is g2
    assert [n.meta["pattern_input"] for n in g1.nodes if n.op == "placeholder"] == ["a", "b"]


def test_replacements_carry_provenance_and_fake_values():
    gm = export(lambda x, y: (x + y) * 2.0, (torch.randn(4), torch.randn(4)), {0: {0: "n"}, 1: {0: "n"}})
    PatternMatcher([SCALED_SUM]).apply(gm)
    new = [n for n in gm.graph.nodes if "wb_replaces" in n.meta]
    assert new and all(isinstance(n.meta["val"], torch.Tensor) for n in new)
    assert sorted(new[-1].meta["wb_replaces"]) == ["add", "mul"]
    assert str(new[-1].meta["val"].shape[0]).startswith("s")  # stays symbolic


def test_shareable_nodes_may_feed_outside_users():
    def pat(x, *, eps):
        h = x.to(torch.float32)
        return h * eps

    def rep(x, *, eps):
        return torch.ops.aten.mul.Tensor(x, eps)

    strict = Pattern("p", pat, rep, lambda: (torch.randn(3),), literals={"eps": 0.123})
    relaxed = Pattern("p", pat, rep, lambda: (torch.randn(3),), literals={"eps": 0.123},
                      shareable=(torch.ops.aten.to.dtype,))

    def f(x):
        h = x.to(torch.float32)
        return h * 4.0, h + 1

    assert PatternMatcher([strict]).apply(export(f, (torch.randn(3),)))["p"] == 0
    gm = export(f, (torch.randn(3),))
    assert PatternMatcher([relaxed]).apply(gm)["p"] == 1
    gm.recompile()
    out = gm(torch.ones(3))
    torch.testing.assert_close(out[0], torch.full((3,), 4.0))
    assert copy.deepcopy(out[1]).tolist() == [2.0, 2.0, 2.0]
