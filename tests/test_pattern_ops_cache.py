"""The on-disk table of each pattern's ops (``matcher/anchors.py``): a new process skips the trace
of a pattern one of whose ops the graph lacks, and still matches, and traces, every pattern it can
match."""

import json

import torch
import torch.fx as fx

from workbench.pipeline.matcher import engine
from workbench.pipeline.matcher.anchors import PatternOpsCache, pattern_key
from workbench.pipeline.matcher.engine import Pattern, PatternMatcher
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
    real = engine.export_graph_module
    monkeypatch.setattr(engine, "export_graph_module", lambda fn, *a, **k: traces.append(fn) or real(fn, *a, **k))

    engine.traced_pattern.cache_clear()  # a new process: nothing traced yet
    gm = _graph()
    assert PatternMatcher([BMM, MUL]).apply(gm) == {"bmm_then_view": 0, "mul_then_view": 1}
    assert traces == [_bmm_then_view, _mul_then_view]  # nothing known: both traced
    assert aten.sub.Tensor in _targets(gm) and aten.mul.Tensor not in _targets(gm)
    table = json.loads((tmp_path / "patterns" / "ops.json").read_text())
    assert table[pattern_key(BMM)] == ["aten::view.default", "aten::bmm.default"]  # the anchor first

    engine.traced_pattern.cache_clear()  # the next process
    traces.clear()
    gm = _graph()
    assert PatternMatcher([BMM, MUL]).apply(gm) == {"bmm_then_view": 0, "mul_then_view": 1}
    assert traces == [_mul_then_view]  # bmm is not in the graph: its pattern is skipped untraced
    assert aten.sub.Tensor in _targets(gm)


def test_an_unreadable_or_old_table_only_costs_the_traces(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "patterns").mkdir()
    path = tmp_path / "patterns" / "ops.json"
    for text in ("not json", json.dumps({pattern_key(BMM): "aten::view.default"}), json.dumps([1, 2])):
        path.write_text(text)
        assert PatternOpsCache().ops(BMM) is None  # unknown: the pattern is traced
        engine.traced_pattern.cache_clear()
        assert PatternMatcher([BMM, MUL]).apply(_graph()) == {"bmm_then_view": 0, "mul_then_view": 1}
    path.write_text(json.dumps({pattern_key(BMM): ["aten::view.default", "nosuchns::op.default"]}))
    assert PatternOpsCache().ops(BMM) is None  # an op that does not exist here is not trusted
