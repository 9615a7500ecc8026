"""The pattern matcher itself: literals bound per match, commutative arguments, inner nodes used
outside a match, traced patterns cached, provenance and fake values on replacements, shareable casts;
and ``match_support.count`` refusing a name that is no op (so ``count(...) == 0`` can fail)."""

from __future__ import annotations

import copy

import pytest
import torch
from match_support import count, export, gone, run

from workbench.pipeline.matcher import Pattern, PatternMatcher, traced_pattern


def test_count_refuses_a_name_that_is_no_op():
    gm = export(lambda x: torch.rsqrt(x) + 1.0, (torch.rand(3) + 0.5,))
    assert count(gm, "aten.rsqrt.default") == count(gm, torch.ops.aten.rsqrt.default) == 1
    for wrong in ("aten.rsqrt", "torch_rmsnorm.default", "aten.rsqrtt.default", "aten.rsqrt.Tensorr"):
        with pytest.raises(ValueError, match="names no op overload"):
            count(gm, wrong)


def test_gone_needs_the_op_before():
    gm = export(lambda x: torch.rsqrt(x) * 2.0, (torch.rand(3) + 0.5,))
    out, _ = run("match_rmsnorm_pattern", gm)  # matches nothing here: the graph keeps its ops
    assert not gone(out, "aten.rsqrt.default")  # still there
    with pytest.raises(AssertionError, match="was not in the graph before"):
        gone(out, "aten.softmax.int")


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
