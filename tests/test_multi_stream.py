"""Compile-stage transforms: ``multi_stream_moe``, ``multi_stream_mla_attn``, ``multi_stream_gemm``
and ``fuse_causal_conv_activation``.

On CPU (the default ``require_cuda: true``) each reports skipped with the reason and leaves the
graph unchanged. With ``require_cuda: false`` the rewrite itself runs on CPU, where the stream
markers are pass-throughs: that checks the matching (positive and near-miss cases), the node order
(fork, branch, end, main-stream work, wait, consumer) and that numerics are unchanged. GPU tests
(``@pytest.mark.gpu``) run the rewritten graphs on CUDA streams, eagerly and in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from workbench.ops.capture import capture_blockers
import torch.nn.functional as F
from torch import nn

from workbench import Workbench
from workbench.models import TINY_ARCHS, load_model
from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages
from workbench.pipeline.transforms.compile.aux_streams import AuxEnd, AuxFork, AuxWait
from workbench.pipeline.matcher import export_graph_module

wb = torch.ops.workbench
TOL = 1e-5
COMPILE_KEYS = ["fuse_causal_conv_activation", "multi_stream_moe", "multi_stream_mla_attn",
                "multi_stream_gemm"]


def run(key, gm, ctx=None, stage=Stages.COMPILE, **fields):
    cls = TRANSFORMS.get(key)
    out, info, _ = cls(cls.config_class(stage=stage, **fields))(
        gm, ctx, GraphState(is_clean=True, has_valid_shapes=True))
    return out, info


def markers(gm):
    """Positions of the fork/end/wait call_module nodes, by kind."""
    pos = {}
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "call_module":
            kind = type(gm.get_submodule(n.target)).__name__
            pos.setdefault(kind, []).append(i)
    return pos


def index_of(gm, name):
    return [n.name for n in gm.graph.nodes].index(name)


# ------------------------------------------------------------------------------ tiny modules


class SharedMoE(nn.Module):
    """A Qwen2-MoE/DeepSeek-style block: routed experts plus a gated shared expert."""

    def __init__(self, h=16, i=8, e=4, shared_reads_routing=False):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(e, h))
        self.w13 = nn.Parameter(torch.randn(e, 2 * i, h) / 4)
        self.w2 = nn.Parameter(torch.randn(e, h, i) / 4)
        self.sg, self.su, self.sd = (nn.Parameter(torch.randn(*s) / 4) for s in ((i, h), (i, h), (h, i)))
        self.shared_gate = nn.Parameter(torch.randn(1, h))
        self.shared_reads_routing = shared_reads_routing

    def forward(self, x):
        b, t, h = x.shape
        xt = x.view(-1, h)
        w, idx = wb.torch_moe_topk_softmax(F.linear(xt, self.gate), 2, True)
        routed = wb.torch_moe_fused(xt, idx, w, self.w13, self.w2)
        scale = w[:, :1] if self.shared_reads_routing else torch.sigmoid(F.linear(xt, self.shared_gate))
        shared = wb.torch_swiglu_mlp(xt, self.sg, self.su, self.sd) * scale
        return (routed + shared).view(b, t, h)


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 32, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.q(x).sum(-1) + self.k(x).sum(-1) * self.v(x).sum(-1)


class MLA(nn.Module):
    """DeepSeek-style multi-head latent attention (q LoRA, compressed KV + decoupled RoPE key)."""

    def __init__(self, h=32, n=2, q_lora=16, kv_lora=16, nope=8, rope=4, dv=8):
        super().__init__()
        self.n, self.nope, self.rope, self.dv, self.kv_lora = n, nope, rope, dv, kv_lora
        self.q_a = nn.Linear(h, q_lora, bias=False)
        self.q_norm = nn.Parameter(torch.rand(q_lora) + 0.5)
        self.q_b = nn.Linear(q_lora, n * (nope + rope), bias=False)
        self.kv_a = nn.Linear(h, kv_lora + rope, bias=False)
        self.kv_norm = nn.Parameter(torch.rand(kv_lora) + 0.5)
        self.kv_b = nn.Linear(kv_lora, n * (nope + dv), bias=False)
        self.o = nn.Linear(n * dv, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_b(wb.torch_rmsnorm(self.q_a(x), self.q_norm, 1e-6)).view(b, t, self.n, -1)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], -1)
        c, k_pe = torch.split(self.kv_a(x), [self.kv_lora, self.rope], -1)
        kv = self.kv_b(wb.torch_rmsnorm(c, self.kv_norm, 1e-6)).view(b, t, self.n, -1)
        k_nope, v = torch.split(kv, [self.nope, self.dv], -1)
        q_pe, k_pe = wb.torch_rope_with_explicit_cos_sin(q_pe, k_pe.view(b, t, 1, self.rope), cos, sin, 2)
        qf = torch.cat([q_nope, q_pe], -1)
        kf = torch.cat([k_nope, k_pe.expand(b, t, self.n, self.rope)], -1)
        out = wb.torch_attention(qf, kf, v, is_causal=True, layout="bsnd")
        return self.o(out.reshape(b, t, self.n * self.dv))


def mla_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)


# ------------------------------------------------------------------------------ CPU: skipped


@pytest.fixture(scope="module")
def llama_compiled():
    w = Workbench("tiny:llama")
    w.run()
    return w


@pytest.mark.parametrize("key", COMPILE_KEYS)
def test_skipped_on_cpu_with_reason_and_graph_unchanged(llama_compiled, key):
    w = llama_compiled
    i = w.index(key)
    snap, before = w.snapshots[i], w.snapshots[i - 1]
    assert snap.status == "skipped" and snap.info.skipped
    assert "needs a CUDA device" in snap.info.skip_reason and "cpu" in snap.info.skip_reason
    assert snap.num_nodes == before.num_nodes and snap.op_histogram == before.op_histogram
    # Parameters untouched. (The stepper rebuilds the live graph from the last snapshot after a
    # skip; that rebuild currently re-attaches buffers as plain attributes, so buffer bytes can
    # drop by the 32 B of rotary inv_freq: a graph_copy matter, not this transform's.)
    assert snap.mem_after.param_bytes == snap.mem_before.param_bytes
    assert snap.mem_warning is None and snap.numerics.rmse_ratio <= TOL


@pytest.mark.parametrize("key,module,args", [
    ("multi_stream_moe", SharedMoE, (torch.randn(2, 5, 16),)),
    ("multi_stream_gemm", Three, (torch.randn(2, 5, 16),)),
    ("multi_stream_mla_attn", MLA, mla_args()),
])
def test_module_graph_unchanged_on_cpu_by_default(key, module, args):
    gm = export_graph_module(module(), args)
    code = gm.code
    out, info = run(key, gm)
    assert info.skipped and "CUDA" in info.skip_reason and out.code == code


# ------------------------------------------------------------------------------ CPU: the rewrite


def _check_rewrite(key, gm, args, sites: int, **fields):
    ref = gm(*args)
    out, info = run(key, gm, require_cuda=False, **fields)
    assert not info.skipped and info.num_matches == sites, info
    torch.testing.assert_close(out(*args), ref, atol=TOL, rtol=TOL)
    pos = markers(out)
    if sites:
        assert len(pos["AuxFork"]) == len(pos["AuxEnd"]) == len(pos["AuxWait"]) == sites
        for f, e, wt in zip(pos["AuxFork"], pos["AuxEnd"], pos["AuxWait"]):
            assert f < e < wt
    else:
        assert not pos
    return out, info


def test_moe_shared_expert_on_aux_stream():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    out, info = _check_rewrite("multi_stream_moe", export_graph_module(SharedMoE(), (x,)), (x,), 1)
    site = info.details["sites"][0]
    assert set(site["branch"]) == {"torch_swiglu_mlp", "linear_1", "sigmoid", "mul"}
    assert "torch_moe_fused" in site["overlaps"] and site["input"] == "view"
    (end,), (wait,) = markers(out)["AuxEnd"], markers(out)["AuxWait"]
    assert end < index_of(out, "torch_moe_fused") < wait < index_of(out, "add")


def test_moe_near_miss_shared_branch_reads_routing():
    x = torch.randn(2, 5, 16)
    _check_rewrite("multi_stream_moe", export_graph_module(SharedMoE(shared_reads_routing=True), (x,)), (x,), 0)


def test_moe_tiny_mixtral_has_no_shared_expert():
    w = Workbench("tiny:mixtral")
    w.run_to("fuse_rope")
    gm = w.module
    _check_rewrite("multi_stream_moe", gm, make_args(w), 0)


def make_args(w):
    from workbench.models.export_contract import make_batch

    return make_batch(w.ctx.vocab_size, 2, 9, seed=5).args


def test_moe_tiny_qwen2_moe_shared_experts():
    """A real HF block with shared experts (Qwen2-MoE, random tiny weights): one site per layer."""
    from transformers import Qwen2MoeConfig

    from workbench.models.tiny_archs import COMMON, MOE

    reg = dict(TINY_ARCHS)
    reg["qwen2_moe"] = lambda: Qwen2MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64, **MOE)
    w = Workbench(load_model("tiny:qwen2_moe", tiny_registry=reg))
    w.configure("multi_stream_moe", require_cuda=False)
    w.run_to("multi_stream_moe")
    snap = w.snapshot("multi_stream_moe")
    assert snap.info.num_matches == 2, snap.info
    assert all("torch_moe_fused" in " ".join(s["overlaps"]) for s in snap.info.details["sites"])
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= TOL, (s.key, s.numerics)


def test_gemm_largest_on_aux_siblings_hoisted():
    x = torch.randn(2, 5, 16)
    out, info = _check_rewrite("multi_stream_gemm", export_graph_module(Three(), (x,)), (x,), 1)
    site = info.details["sites"][0]
    assert site["branch"] == ["linear"] and site["hoisted"] == ["linear_1", "linear_2"]
    (end,), (wait,) = markers(out)["AuxEnd"], markers(out)["AuxWait"]
    assert end < index_of(out, "linear_1") < index_of(out, "linear_2") < wait < index_of(out, "sum_1")


def test_gemm_single_linear_is_left_alone():
    lin = nn.Linear(16, 8)
    x = torch.randn(2, 16)
    _check_rewrite("multi_stream_gemm", export_graph_module(lin, (x,)), (x,), 0)


def test_gemm_on_tiny_llama_qkv():
    """Unfused q/k/v (fuse_gemms off): q (the largest) on the aux stream, per layer.

    linear_weight_layout is a CPU-only rewrite (K-major matmuls; on CUDA, where this transform
    runs for real, linears stay linears): off here, so the CPU run sees the CUDA graph's linears."""
    w = Workbench("tiny:llama", overrides={"linear_weight_layout.enabled": False})
    w.enable("fuse_gemms", False)
    w.configure("multi_stream_gemm", require_cuda=False)
    w.run_to("multi_stream_gemm")
    snap = w.snapshot("multi_stream_gemm")
    assert snap.info.num_matches == 2 and snap.numerics.rmse_ratio <= TOL
    assert all(len(s["hoisted"]) == 2 for s in snap.info.details["sites"])
    # After fuse_gemms (the default) every GEMM on an input is already one GEMM: nothing to do.
    w.enable("fuse_gemms", True)
    w.run_to("multi_stream_gemm")
    assert w.snapshot("multi_stream_gemm").info.num_matches == 0


def test_gemm_on_tiny_fp8_llama_after_fuse_gemms(tmp_path):
    """The reference's target: FP8 linears sharing an input. ``fuse_gemms`` leaves per-tensor-scaled
    FP8 weights apart, so each layer keeps Q/K/V and gate/up as sibling FP8 GEMMs: 2 sites per layer,
    the largest on the aux stream; the siblings' scale attributes move up to the fork. The logits
    do not move (the markers pass tensors through)."""
    from workbench.models.tiny_quantized import save_tiny_quantized

    loaded = load_model(str(save_tiny_quantized("llama", "FP8", tmp_path)))
    w = Workbench(loaded, overrides={"linear_weight_layout.enabled": False})
    w.configure("multi_stream_gemm", require_cuda=False)
    w.run_to("multi_stream_gemm")
    snap, before = w.snapshot("multi_stream_gemm"), w.snapshots[w.index("multi_stream_gemm") - 1]
    assert snap.info.num_matches == 4, snap.info.details["refused"]
    sites = snap.info.details["sites"]
    assert all(s["branch"][0].startswith("torch_fp8_linear") for s in sites)
    assert sorted(len(s["overlaps"]) for s in sites) == [1, 1, 2, 2]  # gate || up, q || k, v
    assert snap.numerics.rmse_ratio == pytest.approx(before.numerics.rmse_ratio, rel=1e-6)


def test_mla_pattern0_unfused():
    args = mla_args()
    out, info = _check_rewrite("multi_stream_mla_attn", export_graph_module(MLA(), args), args, 1)
    site = info.details["sites"][0]
    assert site["site"].endswith(":p0") and site["input"] == "x"
    assert {"linear_2", "torch_rmsnorm_1", "linear_3"} <= set(site["branch"])  # kv_a, norm, kv_b
    assert {"linear", "torch_rmsnorm", "linear_1"} <= set(site["overlaps"])  # the Q path
    assert len(site["outputs"]) == 3  # k_nope, v, k_pe


def test_mla_pattern1_after_fuse_gemms():
    args = mla_args()
    gm = export_graph_module(MLA(), args)
    gm, info = run("fuse_gemms", gm, stage=Stages.POST_LOAD_FUSION)
    assert info.num_matches == 1  # q_a and kv_a read the same hidden state
    out, info = _check_rewrite("multi_stream_mla_attn", gm, args, 1)
    site = info.details["sites"][0]
    assert site["site"].endswith(":p1") and "linear_3" in site["branch"]
    assert {"torch_rmsnorm", "linear_1"} <= set(site["overlaps"])


def test_mla_not_found_in_llama_attention(llama_compiled):
    gm = llama_compiled.snapshot("resize_kv_cache").graph_copy.materialize()
    out, info = run("multi_stream_mla_attn", gm, require_cuda=False)
    assert info.num_matches == 0 and not markers(out)


# ------------------------------------------------------------------------------ causal conv


@torch.library.custom_op("wbtest::cached_causal_conv1d", mutates_args=())
def cached_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
    """Stand-in for a cached causal conv op: x [b, c, l], weight [c, k] depthwise, causal."""
    y = F.conv1d(F.pad(x, (weight.shape[1] - 1, 0)), weight.unsqueeze(1), groups=x.shape[1])
    return F.silu(y) if activation == "silu" else y


@cached_causal_conv1d.register_fake
def _(x, weight, activation=None):
    return torch.empty_like(x)


class Conv(nn.Module):
    def __init__(self, act=F.silu, extra_use=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.act, self.extra_use = act, extra_use

    def forward(self, x):
        y = torch.ops.wbtest.cached_causal_conv1d(x, self.w)
        return self.act(y) + (y if self.extra_use else 0)


@pytest.mark.parametrize("module,matches", [(Conv(), 1), (Conv(act=F.gelu), 0), (Conv(extra_use=True), 0)],
                         ids=["silu", "gelu_near_miss", "conv_output_used_twice"])
def test_fuse_causal_conv_activation(module, matches):
    x = torch.randn(2, 6, 9)
    gm = export_graph_module(module, (x,))
    ref = gm(x)
    out, info = run("fuse_causal_conv_activation", gm, require_cuda=False,
                    conv_ops=["wbtest::cached_causal_conv1d", "workbench::no_such_conv"])
    assert info.num_matches == matches and info.details["unregistered"] == ["workbench::no_such_conv"]
    torch.testing.assert_close(out(x), ref, atol=TOL, rtol=TOL)
    convs = [n for n in out.graph.nodes if "cached_causal_conv1d" in str(n.target)]
    assert len(convs) == 1 and (convs[0].kwargs.get("activation") == "silu") == bool(matches)
    acts = [n for n in out.graph.nodes if n.target in (torch.ops.aten.silu.default, torch.ops.aten.gelu.default)]
    assert len(acts) == (0 if matches else 1)


class RealCachedConv(torch.nn.Module):
    """The registered cached causal conv (insert_cached_causal_conv's op) followed by a SiLU."""

    def __init__(self, c: int = 9, k: int = 4):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(c, 1, k) * 0.3)

    def forward(self, x, seq_lens, input_pos, slot_idx, state):
        y = torch.ops.workbench.torch_cached_causal_conv1d(x, self.w, None, seq_lens, input_pos, slot_idx, 2, state)
        return F.silu(y)


def test_fuse_causal_conv_activation_default_ops():
    """With the default conv_ops (the Triton and torch cached convs, both registered) the cached conv
    gets the SiLU folded in (same outputs)."""
    x = torch.randn(1, 6, 9)
    meta = (torch.tensor([4, 2], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))
    gm = export_graph_module(RealCachedConv(), (x, *meta, torch.zeros(3, 9, 3)))
    ref = gm(x, *meta, torch.zeros(3, 9, 3))
    out, info = run("fuse_causal_conv_activation", gm, require_cuda=False)
    assert info.num_matches == 1 and info.details["unregistered"] == []
    torch.testing.assert_close(out(x, *meta, torch.zeros(3, 9, 3)), ref, atol=TOL, rtol=TOL)
    assert not [n for n in out.graph.nodes if n.target is torch.ops.aten.silu.default]
    out, info = run("fuse_causal_conv_activation", gm)
    assert info.skipped and "CUDA" in info.skip_reason


# ------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (auxiliary CUDA stream)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key,module,args", [
    ("multi_stream_moe", SharedMoE, (torch.randn(4, 33, 16),)),
    ("multi_stream_gemm", Three, (torch.randn(4, 33, 16),)),
    ("multi_stream_mla_attn", MLA, mla_args()),
])
def test_gpu_rewrite_runs_on_aux_stream(key, module, args):
    """Eager (and, where the graph can be captured, CUDA-graph replay) on CUDA: same numbers as the
    unrewritten graph, and the branch really ran on another stream (the fork switched streams). The
    MoE graph cannot be captured (its expert dispatch reads on the host): ``capture_blockers`` says so,
    which is what keeps ``compile_model`` from capturing it."""
    args = tuple(a.cuda() for a in args)
    gm = export_graph_module(module().cuda(), args)
    ref = gm(*args)
    ctx = type("Ctx", (), {"device": torch.device("cuda")})()
    out, info = run(key, gm, ctx)
    assert not info.skipped and info.num_matches == 1, info
    seen = []
    fork = next(m for m in out.modules() if isinstance(m, AuxFork))
    fork.register_forward_hook(lambda *_: seen.append(torch.cuda.current_stream()))
    main = torch.cuda.current_stream()
    torch.testing.assert_close(out(*args), ref, atol=1e-4, rtol=1e-4)
    assert seen and seen[0] != main and torch.cuda.current_stream() == main
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out(*args)
    main.wait_stream(side)
    blockers = capture_blockers(out)
    if key == "multi_stream_moe":  # MoE dispatch reads which experts got tokens on the host
        assert any("torch_moe_fused" in why for why in blockers.values()), blockers
        return
    assert blockers == {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = out(*args)
    graph.replay()
    torch.testing.assert_close(captured, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_pipeline_with_multi_stream():
    w = Workbench("tiny:llama", device="cuda", dtype="float32")  # the bound below is fp32's
    w.enable("fuse_gemms", False)  # leave q/k/v separate so multi_stream_gemm has work
    w.run()
    assert w.snapshot("multi_stream_gemm").info.num_matches == 2
    assert w.snapshot("multi_stream_moe").status == "done"
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= 1e-4, (s.key, s.numerics)


def test_markers_are_passthroughs_on_cpu():
    from workbench.pipeline.transforms.compile.aux_streams import AuxSite, AuxStreams

    site = AuxSite(AuxStreams(), "t")
    x, y = torch.randn(3), torch.randn(2)
    assert AuxFork(site)(x) is x
    assert AuxEnd(site)(x, y) == (x, y) and AuxWait(site)(x) is x
