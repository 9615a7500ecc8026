"""The plain CPU runner steps the finished graph as a C++ step program (``runtime/step_program.py``):
one boxed dispatcher call per node and no Python between them. It must give the graph's own
logits and tokens bit for bit, and a graph it cannot express is stepped from Python instead, with
the reason said."""

import operator

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from workbench.ops import cpu_kernels
from workbench.runtime.runner_for import plain_step, runner_for
from workbench.runtime.step_program import StepProgramFn, build

WHY = cpu_kernels.load_step_program()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the step program's library: {WHY}")
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


def test_the_cpu_runner_steps_the_graph_as_a_program_with_the_graphs_tokens_and_logits(tiny_llama_done):
    wb = tiny_llama_done
    runner = wb._runner_for_generate(runner_for)
    program = runner.fn
    assert isinstance(program, StepProgramFn) and runner.module is wb.module
    calls = [n for n in wb.module.graph.nodes if n.op == "call_function"]
    # one instruction per call, except the getitems of a multi-result op (rope's q and k): aliases
    aliases = [
        n for n in calls if n.target is operator.getitem and len(n.args[0].target._schema.returns) > 1
    ]
    assert aliases and program.num_calls == len(calls) - len(aliases)
    assert runner.step_form == f"C++ step program ({program.num_calls} calls a step)"
    try:
        with_program = wb.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]).token_ids
        runner.fn = wb.module
        with_graph = wb.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]).token_ids
    finally:
        runner.fn = program
    assert with_program == with_graph
    with torch.no_grad():  # a prefill through the cache path (the numerics probe's forward)
        a, b = wb.ctx.cache.probe(program, wb.probe), wb.ctx.cache.probe(wb.module, wb.probe)
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_scalars_lists_and_several_results_are_passed_as_python_passes_them():
    weight = torch.arange(2, dtype=torch.int32).reshape(1, 2) + 7

    def f(x, y, idx):
        # a weight (get_attr) inside a list argument, as falcon's and recurrent_gemma's graphs have
        z = torch.cat([x, weight, y]) * 2.5  # aten.mul.Tensor(t, 2.5): a wrapped number, not a float64 tensor
        a, b = torch.split(z, [1, 4])  # split_with_sizes: a list result, read by getitem
        return a.reshape(-1) + 1, b.sum(dim=0, keepdim=True), idx.to(torch.float64) * 0.5

    args = (torch.arange(2, dtype=torch.int32).reshape(1, 2), torch.arange(6, dtype=torch.int32).reshape(3, 2),
            torch.tensor([3]))
    gm = make_fx(f)(*args)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    program, why = build(gm)
    assert program is not None, why
    want, got = gm(*args), program(*args)
    assert len(want) == len(got) == 3
    for w, g in zip(want, got):
        # int32 * 2.5 is float32 (a Python scalar does not raise the dtype; a float64 tensor would)
        assert w.dtype == g.dtype and torch.equal(w, g)
    assert want[0].dtype == torch.float32
    with pytest.raises(RuntimeError, match="the step program takes 3 inputs, got 2"):
        program.program.run([args[0], args[1]])
    # an operator's own error keeps its type and message, and names the graph node it came from
    with pytest.raises(RuntimeError) as err:
        program(args[0], torch.zeros(3, 5, dtype=torch.int32), args[2])
    cat = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    assert "Sizes of tensors must match" in str(err.value)
    assert f"in the step program, at graph node {cat} (aten::cat)" in str(err.value)
    pick = make_fx(lambda x, i: x.index_select(0, i))(torch.ones(3, 2), torch.tensor([1]))
    with pytest.raises(IndexError) as graph_err:
        pick(torch.ones(3, 2), torch.tensor([7]))
    with pytest.raises(IndexError) as program_err:  # not a RuntimeError: the type a user would catch
        build(pick)[0](torch.ones(3, 2), torch.tensor([7]))
    assert str(graph_err.value).splitlines()[0] in str(program_err.value)


def test_a_graph_it_cannot_express_is_stepped_from_python_with_the_reason():
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))  # call_module, not an operator call
    program, why = build(gm)
    assert program is None and why == "_0: call_module 0"
    traced = fx.symbolic_trace(lambda x: torch.relu(x) + 1)  # a Python function, not an OpOverload
    program, why = build(traced)
    assert program is None and why == "relu: calls relu, not an operator"
    fn, form = plain_step(traced, torch.device("cpu"))
    assert isinstance(fn, fx.GraphModule) and form == "Python graph (relu: calls relu, not an operator)"
    assert torch.equal(fn(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 3.0]))
    # sizes computed in Python (a symbolic trace's s0 * 2) are not operator calls either
    sym = make_fx(lambda x: x.reshape(x.shape[0] * 2, -1), tracing_mode="symbolic")(torch.ones(4, 6))
    program, why = build(sym)
    assert program is None and "calls mul, not an operator" in why
    assert build(torch.nn.Linear(2, 2)) == (None, "Linear is not a graph")


def test_without_the_step_program_library_the_runner_steps_the_lean_copy_and_says_why(tiny_llama_done, monkeypatch):
    # a machine with no compiler: the library that holds the program is not there
    why = "`g++` is not installed (the Makefile's install step installs it)"
    monkeypatch.setattr(cpu_kernels, "load_step_program", lambda: why)
    graph = tiny_llama_done.module
    fn, form = plain_step(graph, torch.device("cpu"))
    assert isinstance(fn, fx.GraphModule) and fn is not graph  # the lean copy
    assert form == f"Python graph ({why})"
    fn, form = plain_step(graph, torch.device("cuda"))  # not built for a CUDA graph: its runners replace it
    assert isinstance(fn, fx.GraphModule) and form.startswith("Python graph (runs on CUDA")
