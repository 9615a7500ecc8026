"""The lean copy of the finished graph (``runtime/lean_graph.py``), which the plain runner steps
from Python where the C++ step program cannot run the graph (``test_step_program.py``): views,
reshapes, sizes and splits as Tensor methods, tensor adds as ``+``. The pipeline's graph is left as
it is, the copy shares its tensors, and logits and tokens are bitwise those of the graph itself."""

import operator

import torch
import torch.fx as fx

from workbench.runtime.runner_for import runner_for
from workbench.runtime.lean_graph import TENSOR_METHODS, lean_copy, rewritten_nodes

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


def _runner(wb):
    return wb._runner_for_generate(runner_for)


def test_the_lean_copy_leaves_the_graph_unchanged_and_shares_its_tensors(tiny_llama_done):
    wb = tiny_llama_done
    graph = wb.module
    lean = lean_copy(graph)
    assert isinstance(lean, fx.GraphModule) and lean is not graph
    n = rewritten_nodes(graph)
    assert n > 20  # tiny:llama's views, reshapes, sizes, splits and residual adds
    assert len(lean.graph.nodes) == len(graph.graph.nodes)
    methods = [x for x in lean.graph.nodes if x.op == "call_method"]
    adds = [x for x in lean.graph.nodes if x.target is operator.add]
    assert len(methods) + len(adds) == n and {m.target for m in methods} <= set(TENSOR_METHODS.values())
    # the pipeline's graph keeps its ATen ops (snapshots, renders and the cost model read it)
    assert not any(x.op == "call_method" for x in graph.graph.nodes)
    assert sum(1 for x in graph.graph.nodes if x.target in TENSOR_METHODS) == len(methods)
    shared = {id(t) for t in graph.state_dict(keep_vars=True).values()}
    assert {id(t) for t in lean.state_dict(keep_vars=True).values()} <= shared  # no tensor copied
    # every weight read as one flat attribute of the copy, the same tensor as the graph's
    reads = [x for x in lean.graph.nodes if x.op == "get_attr"]
    assert reads and all("." not in x.target for x in reads)
    originals = {x.name: x.target for x in graph.graph.nodes if x.op == "get_attr"}
    for x in reads:
        value = graph
        for part in originals[x.name].split("."):
            value = getattr(value, part)
        assert getattr(lean, x.target) is value


def test_the_lean_copy_gives_the_graphs_tokens_and_logits_bit_for_bit(tiny_llama_done):
    wb = tiny_llama_done
    runner = _runner(wb)
    before, lean = runner.fn, lean_copy(wb.module)
    runner.fn = lean
    try:
        lean_tokens = wb.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]).token_ids
        runner.fn = wb.module  # the graph itself
        plain_tokens = wb.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]).token_ids
    finally:
        runner.fn = before
    assert lean_tokens == plain_tokens
    # the numerics probe's forward (prefill through the cache path) on both: the same bits
    with torch.no_grad():
        a, b = wb.ctx.cache.probe(lean, wb.probe), wb.ctx.cache.probe(wb.module, wb.probe)
    assert a.shape == b.shape and torch.equal(a, b)


def test_a_module_that_is_not_a_graph_is_run_as_it_is():
    m = torch.nn.Linear(2, 2)
    assert lean_copy(m) is m and rewritten_nodes(m) == 0
