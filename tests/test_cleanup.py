"""The post-export cleanups and the identity dtype-cast cleanup on hand-built graphs.

Each rule: a positive case (node removed, match counted, numerics unchanged) and near misses that
must stay.
"""

import pytest
import torch
import torch.fx as fx

from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages

aten, prims = torch.ops.aten, torch.ops.prims


def run_transform(key: str, gm: fx.GraphModule, stage=Stages.POST_EXPORT):
    cls = TRANSFORMS.get(key)
    t = cls(cls.config_class(stage=stage))
    out, info, _ = t(gm, None, GraphState())
    return out, info


def graph_of(build, *inputs: torch.Tensor) -> fx.GraphModule:
    """A GraphModule from ``build(graph, *placeholders) -> output`` with real tensors as meta['val']."""
    g = fx.Graph()
    phs = []
    for i, x in enumerate(inputs):
        p = g.placeholder(f"x{i}")
        p.meta["val"] = x
        phs.append(p)
    out = build(g, *phs)
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    # Record output metadata the way export would.
    for node in gm.graph.nodes:
        if node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
    return gm


def count(gm, target):
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


X = torch.randn(2, 8, 4)


# ---------------------------------------------------------------- cleanup_noop_slice
@pytest.mark.parametrize("end", [8, 2**63 - 1, None])
def test_noop_slice_removed(end):
    gm = graph_of(lambda g, x: g.call_function(aten.slice.Tensor, (x, 1, 0, end, 1)), X)
    out, info = run_transform("cleanup_noop_slice", gm)
    assert info.num_matches == 1 and count(out, aten.slice.Tensor) == 0
    torch.testing.assert_close(out(X), X)


@pytest.mark.parametrize("args", [(1, 1, 8, 1), (1, 0, 7, 1), (1, 0, 8, 2)])
def test_partial_slice_kept(args):
    gm = graph_of(lambda g, x: g.call_function(aten.slice.Tensor, (x, *args)), X)
    ref = gm(X)
    out, info = run_transform("cleanup_noop_slice", gm)
    assert info.num_matches == 0 and count(out, aten.slice.Tensor) == 1
    torch.testing.assert_close(out(X), ref)


def test_noop_slice_with_symbolic_end_in_exported_graph():
    class M(torch.nn.Module):
        def forward(self, x):
            return x[:, : x.shape[1]].sum(1) + x[:, 1:].sum(1)  # a full slice and a partial one

    x = torch.randn(2, 8)
    ep = torch.export.export(M(), (x,), dynamic_shapes=({0: torch.export.Dim("b"), 1: torch.export.Dim("s", min=3)},))
    gm = ep.module()
    # Export spells these as slice(x, 1, None, s) [symbolic end], slice(x, 0, 0, INT64_MAX) and
    # slice(_, 1, 1, INT64_MAX); only the last one selects a strict part.
    assert count(gm, aten.slice.Tensor) == 3
    out, info = run_transform("cleanup_noop_slice", gm)
    assert info.num_matches == 2 and count(out, aten.slice.Tensor) == 1
    (kept,) = [n for n in out.graph.nodes if n.target is aten.slice.Tensor]
    assert kept.args[1:3] == (1, 1)
    y = torch.randn(3, 5)
    torch.testing.assert_close(out(y), M()(y))


# ---------------------------------------------------------------- cleanup_noop_add
def test_add_scalar_zero_removed():
    gm = graph_of(lambda g, x: g.call_function(aten.mul.Tensor, (g.call_function(aten.add.Tensor, (x, 0)), 3)), X)
    out, info = run_transform("cleanup_noop_add", gm)
    assert info.num_matches == 1 and count(out, aten.add.Tensor) == 0
    torch.testing.assert_close(out(X), X * 3)


def test_add_zeros_tensor_removed():
    def build(g, x):
        z = g.call_function(aten.zeros_like.default, (x,))
        return g.call_function(aten.add.Tensor, (z, x))

    gm = graph_of(build, X)
    out, info = run_transform("cleanup_noop_add", gm)
    assert info.num_matches == 1
    torch.testing.assert_close(out(X), X)


def test_add_near_misses_kept():
    def broadcast(g, x):  # zeros of a bigger shape: the add broadcasts, not an identity
        z = g.call_function(aten.zeros.default, ([3, 2, 8, 4],))
        return g.call_function(aten.add.Tensor, (x, z))

    def alpha(g, x):  # 0 + x * 2
        z = g.call_function(aten.zeros_like.default, (x,))
        return g.call_function(aten.add.Tensor, (z, x), {"alpha": 2})

    def one(g, x):
        return g.call_function(aten.add.Tensor, (x, 1))

    def promote(g, x):  # int + 0.0 promotes to float
        return g.call_function(aten.add.Tensor, (x, 0.0))

    for build, inp in [(broadcast, X), (alpha, X), (one, X), (promote, torch.arange(4))]:
        gm = graph_of(build, inp)
        ref = gm(inp)
        out, info = run_transform("cleanup_noop_add", gm)
        assert info.num_matches == 0, build.__name__
        torch.testing.assert_close(out(inp), ref)


# ---------------------------------------------------------------- cleanup_identity_dtype_cast
@pytest.mark.parametrize(
    "target, args, kwargs",
    [
        (aten.to.dtype, (torch.float32,), {}),
        (aten._to_copy.default, (), {"dtype": torch.float32}),
        (aten._to_copy.default, (), {"dtype": torch.float32, "device": torch.device("cpu")}),
        (prims.convert_element_type.default, (torch.float32,), {}),
    ],
)
def test_identity_cast_removed_for_each_spelling(target, args, kwargs):
    gm = graph_of(lambda g, x: g.call_function(target, (x, *args), kwargs), X)
    out, info = run_transform("cleanup_identity_dtype_cast", gm, Stages.COMPILE)
    assert info.num_matches == 1 and count(out, target) == 0
    torch.testing.assert_close(out(X), X)


@pytest.mark.parametrize(
    "target, args, kwargs",
    [
        (aten.to.dtype, (torch.float16,), {}),  # a real conversion
        (aten.to.dtype, (torch.float32, False, True), {}),  # copy=True: a fresh tensor is observable
        (aten.to.dtype, (torch.float32, False, False, torch.channels_last), {}),  # memory format
        (aten._to_copy.default, (), {"dtype": torch.bfloat16}),
        (aten._to_copy.default, (), {"dtype": torch.float32, "device": torch.device("meta")}),
        (aten._to_copy.default, (), {"dtype": torch.float32, "layout": torch.sparse_coo}),
        (prims.convert_element_type.default, (torch.float64,), {}),
    ],
)
def test_non_identity_casts_kept(target, args, kwargs):
    x = torch.randn(2, 3, 4, 5)
    g = fx.Graph()
    p = g.placeholder("x")
    p.meta["val"] = x
    g.output(g.call_function(target, (p, *args), kwargs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    out, info = run_transform("cleanup_identity_dtype_cast", gm, Stages.COMPILE)
    assert info.num_matches == 0 and count(out, target) == 1


def test_cast_without_metadata_is_left_alone():
    g = fx.Graph()
    p = g.placeholder("x")  # no meta['val']: cannot prove identity
    g.output(g.call_function(aten.to.dtype, (p, torch.float32)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    _, info = run_transform("cleanup_identity_dtype_cast", gm, Stages.COMPILE)
    assert info.num_matches == 0


# ---------------------------------------------------------------- cleanup_input_constraints
def test_input_constraints_removed_so_new_signatures_run():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.sin() * 2

    b = torch.export.Dim("b", min=1, max=4)
    gm = torch.export.export(M(), (torch.randn(2, 3),), dynamic_shapes=({0: b},)).module()
    with pytest.raises(Exception):
        gm(torch.randn(8, 3))  # batch 8 > max 4: export's checks refuse
    out, info = run_transform("cleanup_input_constraints", gm)
    assert info.num_matches >= 1
    assert not any(n.op == "call_module" and n.target == "_guards_fn" for n in out.graph.nodes)
    x = torch.randn(8, 3)
    torch.testing.assert_close(out(x), x.sin() * 2)
    _, again = run_transform("cleanup_input_constraints", out)
    assert again.num_matches == 0
