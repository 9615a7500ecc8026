"""What a user gets on a GPU by default, checked on any machine: ``device="auto"``, attention
``auto`` picking a backend CUDA graphs can capture (FlashInfer where it serves the shapes, else
Triton), and ``compile_model: auto`` resolving to CUDA graphs exactly when every node of the graph
can be captured. CUDA is faked where needed: through the backends' ``is_available`` hooks (what
the backend registry asks) and ``torch.cuda``'s availability."""

from __future__ import annotations

import copy

import pytest
import torch

from workbench import Workbench
from workbench.models import load_model
from workbench.ops.backends import ATTENTION_BACKENDS
from workbench.ops.capture import capture_blockers, node_blocker
from workbench.pipeline.transforms.caches.attention_backend import LayerShape
from workbench.pipeline.transforms.caches.attention_backend import resolve_backend as choose_attention
from workbench.pipeline.transforms.compile.compile_model import resolve_auto

CUDA = torch.device("cuda")


def resolve_backend(*args):
    """(name, op, why) of the attention choice."""
    choice = choose_attention(*args)
    return choice.name, choice.backend.op, choice.why


def _layers(head_dim=64, dtype=torch.bfloat16, sinks=False, n=2):
    return [LayerShape(i, head_dim, head_dim, dtype, sinks) for i in range(n)]


@pytest.fixture
def fake_cuda_backends(monkeypatch):
    """FlashInfer and Triton report that they run on CUDA (the registry asks their modules)."""
    for name in ("flashinfer", "triton"):
        module = ATTENTION_BACKENDS.get(name)._module()
        monkeypatch.setattr(module, "is_available", lambda device: (True, "faked for the test"))


def test_attention_auto_on_cuda_prefers_flashinfer_then_triton(fake_cuda_backends):
    name, op, why = resolve_backend("auto", CUDA, _layers())
    assert name == "flashinfer" and op is torch.ops.workbench.flashinfer_cached_attention.default
    assert why == "auto on cuda: flashinfer"
    # shapes FlashInfer has no kernels for go to Triton, and the reason says so
    name, _, why = resolve_backend(None, CUDA, _layers(dtype=torch.float32))
    assert name == "triton" and "flashinfer: dtype float32" in why and "layers [0, 1]" in why
    name, _, why = resolve_backend("auto", CUDA, _layers(head_dim=16))
    assert name == "triton" and "head_dim 16" in why
    name, _, why = resolve_backend("auto", CUDA, _layers(sinks=True))
    assert name == "triton" and "sinks" in why


def test_attention_auto_on_cuda_without_flashinfer_or_triton(monkeypatch):
    flashinfer = ATTENTION_BACKENDS.get("flashinfer")._module()
    triton = ATTENTION_BACKENDS.get("triton")._module()
    monkeypatch.setattr(flashinfer, "is_available", lambda d: (False, "optional package missing: flashinfer-python"))
    monkeypatch.setattr(triton, "is_available", lambda d: (True, "faked"))
    name, _, why = resolve_backend("auto", CUDA, _layers())
    assert name == "triton" and "flashinfer: optional package missing" in why
    monkeypatch.setattr(triton, "is_available", lambda d: (False, "triton is not installed"))
    name, _, why = resolve_backend("auto", CUDA, _layers())
    assert name == "torch" and "triton: triton is not installed" in why


def test_an_explicit_backend_that_cannot_serve_the_shape_names_those_that_can(fake_cuda_backends):
    with pytest.raises(ValueError, match=r"'flashinfer' does not support this model: head_dim 16 .*layers \[0, 1\]"
                                         r".*Use backend 'torch' or 'triton'"):
        choose_attention("flashinfer", CUDA, _layers(head_dim=16))


def test_attention_auto_on_cpu_is_unchanged():
    name, _, why = resolve_backend("auto", torch.device("cpu"), _layers(dtype=torch.float32))
    assert name in ("cpu", "torch") and why.startswith("auto on cpu")


@pytest.fixture(scope="module")
def cached_llama():
    """tiny:llama through the cache stage with the torch attention (runs on this CPU)."""
    wb = Workbench("tiny:llama", numerics=False, overrides={"insert_cached_attention.backend": "torch"})
    wb.run_to("resize_kv_cache")
    return wb.snapshot("resize_kv_cache").module


def _with_attention(gm: torch.fx.GraphModule, op) -> torch.fx.GraphModule:
    """A copy of the cached graph calling ``op`` where it calls the torch cached attention (what
    insert_cached_attention writes for that backend on a GPU)."""
    graph = copy.deepcopy(gm.graph)
    for n in graph.nodes:
        if n.target is torch.ops.workbench.torch_cached_attention.default:
            n.target = op
    return torch.fx.GraphModule(gm, graph)


def test_compile_auto_on_cuda_captures_only_graphs_without_host_reads(cached_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA-graph backends can run
    blockers = capture_blockers(cached_llama)
    assert len(blockers) == 2 and all("torch_cached_attention: reads seq_lens" in w for w in blockers.values())
    name, why = resolve_auto(CUDA, blockers)
    assert name == "torch-simple" and "2 node(s)" in why and "insert_cached_attention.backend=triton" in why
    for op in (torch.ops.workbench.triton_cached_attention.default, torch.ops.workbench.flashinfer_cached_attention.default):
        assert capture_blockers(_with_attention(cached_llama, op)) == {}
        assert resolve_auto(CUDA, {}) == ("torch-cudagraph", "auto on cuda: torch-cudagraph (every node of the "
                                                             "graph can be captured)")
    assert resolve_auto(torch.device("cpu"), {})[0] == "torch-simple"


def test_a_refused_capture_names_the_attention_choice_that_blocks_it(cached_llama, monkeypatch):
    """compile_model reads the cache stage's typed attention choice (ctx.cache.attention): when that
    backend's op is the one that cannot be captured, the refusal says which backend and why it was
    chosen; a capturable choice is not blamed."""
    from workbench.ops.backends import ATTENTION_BACKENDS
    from workbench.ops.registry import Choice
    from workbench.pipeline.transforms.compile.compile_model import choose_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA-graph backends can run
    blockers = capture_blockers(cached_llama)
    torch_choice = Choice(ATTENTION_BACKENDS.get("torch"), "explicit: torch")
    with pytest.raises(ValueError, match=r"the cached attention is 'torch' \(explicit: torch\)"):
        choose_backend("torch-cudagraph", CUDA, blockers, torch_choice)
    triton_choice = Choice(ATTENTION_BACKENDS.get("triton"), "auto on cuda: triton")
    with pytest.raises(ValueError, match="cannot capture") as refused:
        choose_backend("torch-cudagraph", CUDA, blockers, triton_choice)
    assert "the cached attention is" not in str(refused.value)


# gpt-oss: its grouped-mm MoE is matched into torch_moe_fused (biases, clamped SwiGLU), which says why
@pytest.mark.parametrize("arch, blocker", [("mixtral", "workbench::torch_moe_fused: runs only the experts"),
                                           ("gpt_oss", "workbench::torch_moe_fused: runs only the experts")])
def test_moe_graphs_stay_out_of_cuda_graphs_and_say_why(arch, blocker, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA-graph backends can run
    wb = Workbench(f"tiny:{arch}", numerics=False, overrides={"insert_cached_attention.backend": "torch"})
    wb.run_to("resize_kv_cache")
    gm = _with_attention(wb.snapshot("resize_kv_cache").module, torch.ops.workbench.triton_cached_attention.default)
    whys = set(capture_blockers(gm).values())
    assert any(w.startswith(blocker) for w in whys), whys
    name, why = resolve_auto(CUDA, capture_blockers(gm))
    assert name == "torch-simple" and blocker.split(":")[0] in why


def test_host_reading_aten_ops_and_unknown_callables_are_blockers():
    gm = torch.fx.symbolic_trace(lambda x: (torch.nonzero(x), x + 1))
    names = {n.name: node_blocker(n) for n in gm.graph.nodes}
    assert "not known to be capturable" in names["nonzero"]  # traced as a Python function, not an aten op
    g = torch.fx.Graph()
    x = g.placeholder("x")
    nz = g.call_function(torch.ops.aten.nonzero.default, (x,))
    item = g.call_function(torch.ops.aten._local_scalar_dense.default, (x,))
    ok = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    g.output((nz, item, ok))
    assert "nonzero" in node_blocker(nz) and ".item()" in node_blocker(item) and node_blocker(ok) is None
    assert list(capture_blockers(torch.nn.Linear(2, 2)).values()) == [
        "not an exported graph: its ops cannot be checked for host reads"]


@pytest.mark.real_devices
def test_device_auto_is_cuda_when_a_gpu_is_visible(monkeypatch):
    from workbench.cli import build_parser
    from workbench.models.devices import resolve_device
    from workbench.models.dtypes import resolve_dtype

    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == CUDA and resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", CUDA) is torch.bfloat16 and resolve_dtype("auto", "cpu") is torch.float32
    args = build_parser().parse_args(["run"])
    assert (args.device, args.dtype) == ("auto", "auto")


@pytest.mark.real_devices
def test_workbench_and_load_model_default_to_auto():
    import inspect

    for fn in (Workbench.__init__, load_model):
        params = inspect.signature(fn).parameters
        assert params["device"].default == "auto" and params["dtype"].default == "auto", fn
    wb = Workbench("tiny:llama", numerics=False)  # this machine: CUDA if it has one
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert wb.ctx.device.type == want.type
    assert wb.ctx.dtype is (torch.bfloat16 if want.type == "cuda" else torch.float32)
    # a model loaded on the CPU keeps the pipeline there under "auto"
    cpu = load_model("tiny:llama", device="cpu")
    assert Workbench(cpu, numerics=False).ctx.device == torch.device("cpu")
