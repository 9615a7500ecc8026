"""Stage ``post_load_fusion`` on CPU: ``fuse_gemms``, ``fuse_swiglu``, ``fuse_rmsnorm``, ``fuse_rope``.

Per transform: a tiny exported module (positive and near-miss), numerics against the graph before
(the canonical ops) at two shapes, match and op counts, and for the weight-concatenating ones the
memory accounting (snapshot delta == bytes of the new weights - bytes of the freed originals, tied
weights kept). Then ``tiny:llama`` / ``tiny:mixtral`` graphs after the pattern stage, and the whole
default pipeline (tiny:llama here, SmolLM2 in the slow test) with rmse_ratio <= 1e-5 at every
snapshot. Triton kernels and the Triton backends run in ``test_triton_norm_rope.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from match_support import count

from workbench import Workbench
from workbench.models.export_contract import make_batch
from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages, TransformError
from workbench.pipeline.memory import measure
from workbench.pipeline.matcher import export_graph_module

wb = torch.ops.workbench
TOL = 1e-5
LAST_PATTERN = "detect_hidden_states_for_capture"


def export(mod, args, dynamic=True):
    spec = None
    if dynamic:
        b, s = torch.export.Dim("b", min=1, max=64), torch.export.Dim("s", min=2, max=64)
        spec = tuple({0: b, 1: s} if a.dim() == 3 else None for a in args)
    return export_graph_module(mod, args, dynamic_shapes=spec)


def run(key, gm, **fields):
    cls = TRANSFORMS.get(key)
    cfg = cls.config_class(stage=Stages.POST_LOAD_FUSION, **fields)
    out, info, _ = cls(cfg)(gm, None, GraphState(is_clean=True, has_valid_shapes=True))
    return out, info


def tracked(gm):
    return measure(gm, 0, torch.device("cpu")).tracked_bytes


# ------------------------------------------------------------------------------ fuse_gemms


class QKV(torch.nn.Module):
    """Llama attention's projections, consumed the way the model consumes them (views)."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, d=8, bias=False):
        super().__init__()
        self.d = d
        self.q = torch.nn.Linear(hidden, heads * d, bias=bias)
        self.k = torch.nn.Linear(hidden, kv_heads * d, bias=bias)
        self.v = torch.nn.Linear(hidden, kv_heads * d, bias=bias)
        self.o = torch.nn.Linear(heads * d, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.d)
        k = self.k(x).view(b, s, -1, self.d)
        v = self.v(x).view(b, s, -1, self.d)
        out = wb.torch_attention(q, k, v, is_causal=True, layout="bsnd")
        return self.o(out.reshape(b, s, -1))


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_gemms_qkv(bias):
    torch.manual_seed(0)
    x, x2 = torch.randn(2, 7, 32), torch.randn(3, 5, 32)
    gm = export(QKV(bias=bias), (x,))
    refs = [gm(x), gm(x2)]
    before = tracked(gm)
    out, info = run("fuse_gemms", gm)
    assert info.num_matches == 1 and info.details["groups"] == [["linear", "linear_1", "linear_2"]]
    assert count(out, "aten.linear.default") == 2 and count(out, "aten.split_with_sizes.default") == 1
    for a, ref in zip((x, x2), refs):
        torch.testing.assert_close(out(a), ref, atol=TOL, rtol=TOL)
    names = {n for n, _ in out.named_parameters()}
    assert "fused_q_k_v_weight" in names and not {"q.weight", "k.weight", "v.weight"} & names
    assert ("fused_q_k_v_bias" in names) == bias
    new = (64 * 32 + (64 if bias else 0)) * 4
    assert info.details["new_bytes"] == info.details["freed_bytes"] == new
    assert tracked(out) - before == info.details["new_bytes"] - info.details["freed_bytes"] == 0
    b, s = torch.export.Dim("b", min=1, max=64), torch.export.Dim("s", min=2, max=64)
    torch.export.export(out, (x,), dynamic_shapes=({0: b, 1: s},), strict=False)  # still exports


class Tied(torch.nn.Module):
    """k's weight is also the weight of a linear on another input: it must stay."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 24, bias=False)
        self.k = torch.nn.Linear(16, 8, bias=False)
        self.other = torch.nn.Linear(16, 8, bias=False)
        self.other.weight = self.k.weight

    def forward(self, x, y):
        return self.q(x).sum(-1, keepdim=True) * self.k(x) + self.other(y)


def test_fuse_gemms_keeps_tied_weight_and_reports_honest_memory():
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    gm = export(Tied(), (x, y), dynamic=False)
    ref, before = gm(x, y), tracked(gm)
    out, info = run("fuse_gemms", gm)
    assert info.num_matches == 1
    torch.testing.assert_close(out(x, y), ref, atol=TOL, rtol=TOL)
    d = info.details
    # export names the shared parameter once (here ``other.weight``): that attribute stays, as a
    # view of its rows of the fused weight (alias_rows), so its own bytes are freed too
    assert d["new_bytes"] == d["freed_bytes"] == (24 + 8) * 16 * 4
    assert len(d["kept_originals"]) == 1 and d["kept_originals"][0].endswith("weight")
    assert tracked(out) - before == d["new_bytes"] - d["freed_bytes"] == 0
    kept = out.get_parameter(d["kept_originals"][0])
    fused = next(p for n, p in out.named_parameters() if "fused" in n)
    assert kept.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_alias_rows_holds_the_weights_once_and_refuses_what_it_cannot_lay_out():
    from workbench.pipeline.graph.weights import alias_rows

    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    values = [t.clone() for t in (q, k, v)]
    fused = torch.cat([q, k, v])
    assert alias_rows(fused, [q, k, v])
    for t, want in zip((q, k, v), values):
        assert torch.equal(t, want) and t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert [t.storage_offset() for t in (q, k, v)] == [0, 32, 40]
    # not what torch.cat laid out along dim 0: left alone
    a, b = torch.randn(4, 8).t(), torch.randn(8, 4)  # a is a transposed view
    assert not alias_rows(torch.cat([a, b]), [a, b])
    c, d = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    assert not alias_rows(torch.cat([c, c]), [c, d])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


class NearMiss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 8, bias=False)
        self.b = torch.nn.Linear(16, 8, bias=True)  # bias vs no bias: different buckets
        self.c = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x, y, w):
        # a and b share x but not the bias spelling; c reads another input; the last weight is an
        # input (nothing to concatenate at load time).
        return self.a(x) + self.b(x) + self.c(y) + F.linear(x, w)


def test_fuse_gemms_near_misses_are_left_alone():
    args = (torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(8, 16))
    gm = export(NearMiss(), args, dynamic=False)
    code = gm.code
    out, info = run("fuse_gemms", gm)
    assert info.num_matches == 0 and out.code == code


class Flatten(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 10, bias=False)

    def forward(self, x):
        return self.a(x).view(-1).sum() + self.b(x).view(-1)[:5]


def test_fuse_gemms_turns_impossible_views_into_reshapes():
    x = torch.randn(3, 4, 8)
    gm = export(Flatten(), (x,), dynamic=False)
    ref = gm(x)
    out, info = run("fuse_gemms", gm)
    assert info.num_matches == 1 and info.details["views_made_reshapes"] == 2
    torch.testing.assert_close(out(x), ref, atol=TOL, rtol=TOL)


# ------------------------------------------------------------------------------ fuse_swiglu


class MLP(torch.nn.Module):
    def __init__(self, hidden=16, inter=32, bias=False):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inter, bias=bias)
        self.up = torch.nn.Linear(hidden, inter, bias=bias)
        self.down = torch.nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return wb.torch_swiglu_mlp(x, self.gate.weight, self.up.weight, self.down.weight,
                                   self.gate.bias, self.up.bias, self.down.bias)


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_swiglu(bias):
    torch.manual_seed(0)
    x, x2 = torch.randn(2, 5, 16), torch.randn(1, 9, 16)
    gm = export(MLP(bias=bias), (x,))
    refs, before = [gm(x), gm(x2)], tracked(gm)
    out, info = run("fuse_swiglu", gm, backend="torch")
    assert info.num_matches == 1 and info.details["backend"] == "torch"
    assert count(out, "workbench.torch_swiglu_mlp.default") == 0
    assert count(out, "workbench.torch_silu_and_mul.default") == 1
    assert count(out, "aten.linear.default") == 2
    for a, ref in zip((x, x2), refs):
        torch.testing.assert_close(out(a), ref, atol=TOL, rtol=TOL)
    d = info.details
    assert d["new_bytes"] == d["freed_bytes"] == (2 * 32 * 16 + (64 if bias else 0)) * 4
    assert tracked(out) - before == 0
    assert "fused_gate_up_weight" in dict(out.named_parameters())


def test_fuse_swiglu_leaves_one_sided_bias():
    class OneBias(MLP):
        def forward(self, x):
            return wb.torch_swiglu_mlp(x, self.gate.weight, self.up.weight, self.down.weight,
                                       self.gate.bias, None, None)

    gm = export(OneBias(bias=True), (torch.randn(2, 5, 16),))
    code = gm.code
    out, info = run("fuse_swiglu", gm)
    assert info.num_matches == 0 and out.code == code
    assert "only one of gate/up has a bias" in list(info.details["left"].values())[0]


# ------------------------------------------------------------------------------ backends: selection


class NormRope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, q, k, cos, sin):
        q = wb.torch_rmsnorm(q, self.w, 1e-6)
        return wb.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)


def _norm_rope_gm():
    args = (torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    return export(NormRope(), args, dynamic=False), args


@pytest.mark.parametrize("key", ["fuse_rmsnorm", "fuse_rope"])
def test_auto_on_cpu_picks_the_cpu_kernels_where_they_build(key):
    from workbench.ops import cpu_kernels

    gm, args = _norm_rope_gm()
    ref = gm(*args)
    out, info = run(key, gm, backend="auto")
    expected = "cpu" if cpu_kernels.load() is None else "torch"
    assert info.details["backend"] == expected and info.num_matches == (expected == "cpu")
    got = out(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key", ["fuse_rmsnorm", "fuse_rope"])
@pytest.mark.parametrize("backend", ["torch"])
def test_torch_backend_keeps_the_canonical_op(key, backend):
    gm, args = _norm_rope_gm()
    code = gm.code
    out, info = run(key, gm, backend=backend)
    assert info.num_matches == 0 and out.code == code and not info.skipped
    assert info.details["backend"] == "torch" and info.details["candidates"] == 1
    assert "nothing to swap" in info.details["note"]


@pytest.mark.parametrize("key", ["fuse_rmsnorm", "fuse_rope", "fuse_swiglu"])
def test_triton_without_gpu_or_interpreter_is_a_clear_error(key, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gm = _norm_rope_gm()[0] if key != "fuse_swiglu" else export(MLP(), (torch.randn(2, 5, 16),))
    with pytest.raises(TransformError, match=r"backend 'triton' cannot run on cpu.*TRITON_INTERPRET"):
        run(key, gm, backend="triton")


def test_flashinfer_without_it_names_what_is_missing():
    gm, _ = _norm_rope_gm()
    with pytest.raises(TransformError) as err:
        run("fuse_rmsnorm", gm, backend="flashinfer")
    msg = str(err.value)
    assert "rmsnorm backend 'flashinfer' cannot run" in msg
    # The pipeline device is CPU, so this holds on every machine, GPU or not, flashinfer or not.
    assert "the pipeline device is cpu; FlashInfer kernels need CUDA tensors" in msg
    assert "backend 'torch'" in msg


def test_unknown_backend_is_rejected_by_the_config():
    with pytest.raises(Exception, match="backend"):
        TRANSFORMS.get("fuse_rmsnorm").config_class(stage=Stages.POST_LOAD_FUSION, backend="cuda")
    with pytest.raises(Exception, match="extra"):
        TRANSFORMS.get("fuse_gemms").config_class(stage=Stages.POST_LOAD_FUSION, backend="x")


# ------------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def llama_fused():
    w = Workbench("tiny:llama")
    w.run_to("fuse_rope")
    return w


def test_tiny_llama_post_load_fusion(llama_fused):
    w = llama_fused
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_gemms"].info.num_matches == 2  # q/k/v per layer
    assert snaps["fuse_swiglu"].info.num_matches == 2
    from workbench.ops import cpu_kernels

    kernels = cpu_kernels.load() is None  # auto on CPU: the C++ kernels where they build
    assert snaps["fuse_rmsnorm"].info.num_matches == (5 if kernels else 0)
    assert snaps["fuse_rope"].info.num_matches == (2 if kernels else 0)
    for key in ("fuse_gemms", "fuse_swiglu"):
        d, s = snaps[key].info.details, snaps[key]
        assert s.mem_delta == d["new_bytes"] - d["freed_bytes"], key
        assert s.mem_warning is None
    assert snaps["fuse_gemms"].info.details["new_bytes"] == 2 * (64 + 32 + 32) * 64 * 4
    assert snaps["fuse_swiglu"].info.details["new_bytes"] == 2 * 256 * 64 * 4
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= TOL, (s.key, s.numerics)
    hist = w.snapshots[-1].op_histogram
    # 2 layers x (qkv + o + gate_up + down) + lm_head
    silu = "workbench.cpu_silu_and_mul.default" if kernels else "workbench.torch_silu_and_mul.default"
    assert hist["aten.linear.default"] == 9 and hist[silu] == 2
    assert "workbench.torch_swiglu_mlp.default" not in hist
    params = dict(w.module.named_parameters())
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in params)
    assert "model.model.layers.0.self_attn.fused_q_proj_k_proj_v_proj_weight" in params
    batch = make_batch(w.ctx.vocab_size, 3, 11, seed=7)
    with torch.no_grad():
        ref = w.loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits
        out = w.module(*batch.args)
    assert ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) <= TOL
    torch.export.export(w.module, batch.args, strict=False)


def test_tiny_llama_rewind_and_disable(llama_fused):
    """Toggling a fusion off re-runs from its snapshot; the earlier graph still has its weights."""
    w = llama_fused
    w.enable("fuse_gemms", False)
    w.run_to("fuse_rope")
    assert w.snapshot("fuse_gemms").status == "skipped"
    assert w.snapshots[-1].op_histogram["aten.linear.default"] == 13
    for s in w.snapshots:
        assert s.numerics.rmse_ratio <= TOL
    w.enable("fuse_gemms", True)
    w.run_to("fuse_rope")
    assert w.snapshot("fuse_gemms").info.num_matches == 2


def test_tiny_mixtral_post_load_fusion():
    w = Workbench("tiny:mixtral")
    w.run_to("fuse_rope")
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_gemms"].info.num_matches == 2  # q/k/v; the router linear stands alone
    assert snaps["fuse_swiglu"].info.num_matches == 0  # experts are torch_moe_fused, not swiglu
    assert "no torch_swiglu_mlp" in snaps["fuse_swiglu"].info.details["note"]
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= TOL, (s.key, s.numerics)


def test_default_pipeline_tiny_llama_end_to_end():
    w = Workbench("tiny:llama")
    w.run()
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= TOL, (s.key, s.numerics)
    status = {s.key: s.status for s in w.snapshots}
    assert all(status[k] == "done" for k in ("fuse_gemms", "fuse_swiglu", "fuse_rmsnorm", "fuse_rope"))
    keys = [s.key for s in w.snapshots]
    assert keys.index(LAST_PATTERN) < keys.index("fuse_gemms") < keys.index("insert_cached_attention")
    compile_keys = ["fuse_causal_conv_activation", "multi_stream_moe", "multi_stream_mla_attn",
                    "multi_stream_gemm", "cleanup_identity_dtype_cast"]
    assert [k for k in keys if k in compile_keys] == compile_keys


@pytest.mark.slow
def test_default_pipeline_smollm2_end_to_end(smollm2):
    w = Workbench(smollm2)
    w.run()
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= TOL, (s.key, s.numerics)
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_gemms"].info.num_matches == 30 and snaps["fuse_swiglu"].info.num_matches == 30
    for key in ("fuse_gemms", "fuse_swiglu"):
        d = snaps[key].info.details
        assert snaps[key].mem_delta == d["new_bytes"] - d["freed_bytes"]
    # q/k/v: (576 + 192 + 192) x 576 fp32 per layer
    assert snaps["fuse_gemms"].info.details["new_bytes"] == 30 * 960 * 576 * 4
