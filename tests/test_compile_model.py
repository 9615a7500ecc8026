"""compile_model: config validation, CPU backends (torch-simple, torch-compile), clear errors for
the CUDA backends on CPU, and -- on a GPU -- CUDA-graph generation equal to torch-simple."""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.pipeline.config import ConfigError
from workbench.pipeline.interface import TransformError
from workbench.pipeline.transforms.compile.compile_model import CompileModelConfig
from workbench.runtime.compiled_runner import default_batch_sizes

GPU = torch.cuda.is_available()
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


def cfg(**kw):
    return CompileModelConfig.model_validate({"stage": "compile", **kw})


def test_config_fields_and_validation():
    c = cfg(backend="torch-cudagraph", cuda_graph_batch_sizes=[8, 1, 4, 4])
    assert c.cuda_graph_batch_sizes == [1, 4, 8] and c.piecewise_enabled is False
    with pytest.raises(ValueError, match="backend"):
        cfg(backend="tensorrt")
    with pytest.raises(ValueError, match="positive integers"):
        cfg(backend="torch-cudagraph", cuda_graph_batch_sizes=[0, 2])
    with pytest.raises(ValueError, match="piecewise_enabled needs a CUDA-graph backend"):
        cfg(backend="torch-simple", piecewise_enabled=True)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        cfg(backend="torch-simple", cuda_graphs=True)
    with pytest.raises(ValueError):
        cfg(backend="torch-simple", num_batched_inputs=0)
    assert cfg(backend="torch-compile").static_decode_batch_sizes is None  # the backend's default: [1]
    assert cfg(backend="torch-compile", static_decode_batch_sizes=[2, 1, 2]).static_decode_batch_sizes == [1, 2]
    assert cfg(backend="torch-compile", static_decode_batch_sizes=[]).static_decode_batch_sizes == []
    with pytest.raises(ValueError, match="must be positive batch sizes"):
        cfg(backend="torch-compile", static_decode_batch_sizes=[0])


def test_default_batch_sizes_are_dense_then_coarse_up_to_the_cache_limit():
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64)[-3:] == [32, 48, 64]


def test_bad_backend_in_overrides_fails_before_loading():
    with pytest.raises(ConfigError, match="compile_model"):
        Workbench("tiny:llama", overrides={"compile_model.backend": "torch-fast"})


@pytest.fixture(scope="module")
def wb(tiny_llama_done):
    return tiny_llama_done


def greedy(bench, new=12):
    return bench.generate(PROMPTS, max_new_tokens=new, stop_token_ids=[]).token_ids


def test_torch_simple_is_the_default_and_keeps_the_graph(wb):
    snap = wb.snapshots[-1]
    assert snap.key == "compile_model" and snap.info.details["backend"] == "torch-simple"
    assert wb.ctx.runner is None  # generate builds the plain cached runner


@pytest.mark.skipif(GPU, reason="checks the error a CPU-only machine gives")
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_backends_on_cpu_are_a_clear_error_and_keep_earlier_snapshots(wb, backend):
    before = len(wb.snapshots)
    wb.configure("compile_model", backend=backend)
    try:
        with pytest.raises(TransformError, match="needs a CUDA device; this pipeline runs on cpu") as e:
            wb.run()
        assert "torch-simple" in str(e.value)  # says what to use instead
        assert len(wb.snapshots) == before - 1  # everything before compile_model is kept
    finally:
        wb.configure("compile_model", backend="torch-simple")
        wb.run()


def test_torch_compile_generates_the_same_tokens_as_torch_simple(wb):
    ref = greedy(wb)
    wb.configure("compile_model", backend="torch-compile")
    try:
        wb.run()
        details = wb.snapshots[-1].info.details
        # the compiled copy inlines the torch-backend canonical ops; the snapshot graph still names
        # them. Where the C++ kernels build, RMSNorm/RoPE/SiLU*mul and the linears are kernels (opaque
        # to Inductor) and nothing is left to inline.
        from workbench.ops import cpu_kernels

        if cpu_kernels.load() is None:
            assert details["inlined_ops"] == {}
            assert any("cpu_rmsnorm" in str(n.target) for n in wb.module.graph.nodes)
        else:
            layout = wb.snapshot("linear_weight_layout").info.details["auto"]  # "fp32 linears: <picked> (...)"
            wxt = {"workbench.cpu_linear_wxt.default": 9} if layout.startswith("fp32 linears: wxt ") else {}
            assert details["inlined_ops"] == {"workbench.torch_rmsnorm.default": 5,
                                              "workbench.torch_silu_and_mul.default": 2,
                                              "workbench.torch_rope_with_explicit_cos_sin.default": 2, **wxt}
            assert any("torch_rmsnorm" in str(n.target) for n in wb.module.graph.nodes)
        assert details["check_max_abs_diff"] < 1e-4
        runner = wb.ctx.runner
        assert runner.backend == "compiled" and runner.module is wb.module
        assert greedy(wb) == ref
    finally:
        wb.configure("compile_model", backend="torch-simple")
        wb.run()


def test_torch_compile_runs_single_sequence_decode_through_a_static_graph(wb):
    """bs-1 decode steps skip Dynamo (static_decode.py); other steps and batch sizes go through
    torch.compile; the tokens are torch-simple's either way."""
    one, three = [PROMPTS[1]], PROMPTS
    ref_one, ref_three = wb.generate(one, max_new_tokens=12, stop_token_ids=[]).token_ids, greedy(wb)
    wb.configure("compile_model", backend="torch-compile")
    try:
        wb.run()
        details = wb.snapshots[-1].info.details
        assert details["static_decode_batch_sizes"] == [1]
        assert details["static_decode_check_max_abs_diff"] < 1e-4
        static = wb.ctx.runner.static_decode
        assert static.calls == 0
        assert wb.generate(one, max_new_tokens=12, stop_token_ids=[]).token_ids == ref_one
        assert static.calls == 11  # 12 tokens: the first from the prefill step, 11 decode steps
        assert greedy(wb) == ref_three  # 3 sequences decode together: no static graph for bs 3
        assert static.calls == 11
        wb.configure("compile_model", static_decode_batch_sizes=[])
        wb.run()
        assert wb.ctx.runner.static_decode is None
        assert "static_decode_batch_sizes" not in wb.snapshots[-1].info.details
        wb.configure("compile_model", static_decode_batch_sizes=[1, 10_000])
        with pytest.raises(TransformError, match=r"static_decode_batch_sizes \[10000\] exceed the KV cache's "
                                                 r"max_batch_size=\d+; lower them or raise"):
            wb.run()
    finally:
        wb.configure("compile_model", backend="torch-simple", static_decode_batch_sizes=None)
        wb.run()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_graph_backends_generate_the_same_tokens_as_torch_simple(backend):
    from workbench.models import load_model

    loaded = load_model("tiny:llama", device="cuda", dtype="float32")
    bench = Workbench(loaded, device="cuda", numerics=False, overrides={
        "insert_cached_attention.backend": "triton", "initialize_cache.max_batch_size": 8,
        "compile_model.backend": "torch-simple"})
    bench.run()
    ref = greedy(bench, 24)
    bench.configure("compile_model", backend=backend, cuda_graph_batch_sizes=[1, 2, 4])
    bench.run()
    runner = bench.ctx.runner
    assert sorted(runner.graphs) == [1, 2, 4]
    assert bench.snapshots[-1].info.details["check_max_abs_diff"] < 1e-2
    assert greedy(bench, 24) == ref  # 3 decode sequences replay the graph of 4 (one padding row)
    assert runner.replays > 0
    many = [[i + 1, i + 2] for i in range(6)]  # 6 > 4: decode steps run eagerly
    eager = runner.eager_steps
    out = bench.generate(many, max_new_tokens=4, stop_token_ids=[])
    assert runner.eager_steps > eager and all(len(t) == 4 for t in out.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_refuse_the_host_syncing_torch_attention():
    from workbench.models import load_model

    bench = Workbench(load_model("tiny:llama", device="cuda", dtype="float32"), device="cuda", numerics=False,
                      overrides={"compile_model.backend": "torch-cudagraph",
                                 "insert_cached_attention.backend": "torch"})
    with pytest.raises(TransformError, match=r"cannot capture this graph.*torch_cached_attention: reads seq_lens"):
        bench.run()


def test_auto_backend_resolves_to_the_fastest_for_the_device_and_says_so(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False)  # default YAML: compile_model.backend auto
    wb.run()
    details = wb.snapshots[-1].info.details
    assert details["backend"] == "torch-simple"
    assert details["chosen"].startswith("auto on cpu: torch-simple")
    assert len(wb.generate([[1, 2, 3]], max_new_tokens=4).token_ids[0]) == 4
