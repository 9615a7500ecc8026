"""The on-disk table of each pattern's ops (``matcher/anchors.py``): a new process skips the trace
of a pattern one of whose ops the graph lacks, and still matches, and traces, every pattern it can
match."""

import json
import shutil

import torch
import torch.fx as fx

from workbench.pipeline.matcher import pattern as tracing
from workbench.pipeline.matcher.anchors import PatternOpsCache, pattern_key
from workbench.pipeline.matcher.engine import PatternMatcher
from workbench.pipeline.matcher.pattern import Pattern
from workbench.pipeline.matcher.trace import export_graph_module

aten = torch.ops.aten


def _bmm_then_view(a, b):  # anchor: view; also needs bmm
    return torch.bmm(a, b).view(-1)


def _mul_then_view(a, b):  # anchor: view; needs mul
    return (a * b).view(-1)


def _examples():
    return (torch.randn(2, 3, 3), torch.randn(2, 3, 3))


BMM = Pattern("bmm_then_view", _bmm_then_view, lambda a, b: aten.view.default(aten.add.Tensor(a, b), [-1]), _examples)
MUL = Pattern("mul_then_view", _mul_then_view, lambda a, b: aten.view.default(aten.sub.Tensor(a, b), [-1]), _examples)


def _graph():
    """``(a * b).view(-1)``: a view (both patterns' anchor) and a mul, no bmm."""
    return export_graph_module(_mul_then_view, _examples())


def _targets(gm: fx.GraphModule):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_a_pattern_with_an_absent_op_is_not_traced_by_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    traces = []
    real = tracing.export_graph_module
    monkeypatch.setattr(tracing, "export_graph_module", lambda fn, *a, **k: traces.append(fn) or real(fn, *a, **k))

    tracing.traced_pattern.cache_clear()  # a new process: nothing traced yet
    gm = _graph()
    assert PatternMatcher([BMM, MUL]).apply(gm) == {"bmm_then_view": 0, "mul_then_view": 1}
    assert traces == [_bmm_then_view, _mul_then_view]  # nothing known: both traced
    assert aten.sub.Tensor in _targets(gm) and aten.mul.Tensor not in _targets(gm)
    table = json.loads((tmp_path / "patterns" / "ops.json").read_text())
    assert table[pattern_key(BMM)] == ["aten::view.default", "aten::bmm.default"]  # the anchor first

    tracing.traced_pattern.cache_clear()  # the next process
    traces.clear()
    shutil.rmtree(tmp_path / "patterns" / "graphs")  # only the op table (the mul pattern's graph is stored again)
    gm = _graph()
    assert PatternMatcher([BMM, MUL]).apply(gm) == {"bmm_then_view": 0, "mul_then_view": 1}
    assert traces == [_mul_then_view]  # bmm is not in the graph: its pattern is skipped untraced
    assert aten.sub.Tensor in _targets(gm)

    tracing.traced_pattern.cache_clear()  # a process with the stored pattern graphs too
    traces.clear()
    gm = _graph()
    assert PatternMatcher([BMM, MUL]).apply(gm) == {"bmm_then_view": 0, "mul_then_view": 1}
    assert traces == []  # the mul pattern's graph is read from the store: nothing is exported
    assert aten.sub.Tensor in _targets(gm) and aten.mul.Tensor not in _targets(gm)


def test_an_unreadable_or_old_table_only_costs_the_traces(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "patterns").mkdir()
    path = tmp_path / "patterns" / "ops.json"
    for text in ("not json", json.dumps({pattern_key(BMM): "aten::view.default"}), json.dumps([1, 2])):
        path.write_text(text)
        assert PatternOpsCache().ops(BMM) is None  # unknown: the pattern is traced
        tracing.traced_pattern.cache_clear()
        assert PatternMatcher([BMM, MUL]).apply(_graph()) == {"bmm_then_view": 0, "mul_then_view": 1}
    path.write_text(json.dumps({pattern_key(BMM): ["aten::view.default", "nosuchns::op.default"]}))
    assert PatternOpsCache().ops(BMM) is None  # an op that does not exist here is not trusted


# ------------------------------------------------------------------ stored pattern graphs (JSON)


def _cast_scale_view(x, w):  # literals, dtypes, a list argument, a getitem of a multi-output op
    y = x.to(torch.float32) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    a, b = torch.split(y, [2, 1], dim=-1)
    return (w * (a.sum(-1, keepdim=True) + b)).to(torch.bfloat16).view(-1)


CAST = Pattern(
    "cast_scale_view", _cast_scale_view, lambda x, w: aten.view.default(aten.mul.Tensor(x, w), [-1]),
    lambda: (torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(1)),
)


def _structure(graph: fx.Graph):
    return [(n.op, n.target, n.args, n.kwargs, n.meta.get("pattern_input")) for n in graph.nodes]


def test_a_stored_pattern_graph_is_the_traced_one(tmp_path, monkeypatch):
    from workbench.pipeline.matcher.pattern_store import PatternGraphStore

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    traced = tracing._trace(CAST)
    store = PatternGraphStore()
    store.put(CAST, traced)
    stored = PatternGraphStore().get(CAST)
    assert stored is not None
    # same ops, same arguments (node references by name, floats, dtypes, lists), same input names
    assert [(op, str(t), repr(a), repr(k), i) for op, t, a, k, i in _structure(stored)] == [
        (op, str(t), repr(a), repr(k), i) for op, t, a, k, i in _structure(traced)
    ]
    assert aten.split_with_sizes.default in {n.target for n in stored.nodes}
    assert torch.bfloat16 in [v for n in stored.nodes for v in (*n.args, *n.kwargs.values())]


def test_a_damaged_or_foreign_stored_graph_is_traced_again(tmp_path, monkeypatch):
    from workbench.cache_dir import sealed
    from workbench.pipeline.matcher.pattern_store import PatternGraphStore, graph_to_json

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    traces = []
    real = tracing.export_graph_module
    monkeypatch.setattr(tracing, "export_graph_module", lambda fn, *a, **k: traces.append(fn) or real(fn, *a, **k))
    tracing.traced_pattern.cache_clear()
    assert PatternMatcher([MUL]).apply(_graph()) == {"mul_then_view": 1}
    key = PatternGraphStore.key(MUL)
    path = tmp_path / "patterns" / "graphs" / f"{key}.json"
    good = graph_to_json(tracing._trace(MUL))
    bad_op = json.loads(json.dumps(good).replace("aten::mul.Tensor", "nosuchns::mul.Tensor"))
    for blob in (
        path.read_bytes().replace(b"mul.Tensor", b"add.Tensor"),  # edited: fails its checksum
        sealed(key, json.dumps(bad_op).encode()),  # sealed, but naming an op that does not exist
        sealed(key, b"[1, 2]"),  # sealed junk
    ):
        path.write_bytes(blob)
        tracing.traced_pattern.cache_clear()
        traces.clear()
        gm = _graph()
        assert PatternMatcher([MUL]).apply(gm) == {"mul_then_view": 1}
        assert traces == [_mul_then_view] and aten.sub.Tensor in _targets(gm)


def test_a_pattern_graph_with_a_python_function_is_not_stored(tmp_path, monkeypatch):
    import operator

    from workbench.pipeline.matcher.pattern_store import PatternGraphStore

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(operator.neg, (x,)))
    PatternGraphStore().put(MUL, graph)
    assert not (tmp_path / "patterns" / "graphs").exists() or not list((tmp_path / "patterns" / "graphs").iterdir())
    assert PatternGraphStore().get(MUL) is None
