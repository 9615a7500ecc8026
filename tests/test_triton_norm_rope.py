"""Triton backends of ``post_load_fusion``: ``triton_rmsnorm``, ``triton_rope_with_explicit_cos_sin``,
``triton_silu_and_mul`` against their canonical ops, and the fusion transforms that pick them.

Why a child process: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, and
setting it in this pytest process would switch every other Triton op of the run to the
interpreter. So one child, started with ``TRITON_INTERPRET=1`` as
``python tests/test_triton_norm_rope.py --interpret``, runs every interpreter case on CPU tensors
and prints one JSON line {case: "ok" | traceback}; ``test_interpreter`` turns each entry into its
own pytest result. The child also checks the kernels really are interpreted.

``test_kernels_compile_for_hopper`` compiles the kernels for sm_90 ahead of time on this CPU
machine (what the interpreter does not check). GPU tests (``@pytest.mark.gpu``) run the cases
compiled on CUDA, the FlashInfer backend, and the default pipeline with the Triton backends.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
from triton_child import INTERPRETER_SKIP

import workbench.ops  # noqa: F401  (registers the ops)

wb = torch.ops.workbench
HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
rms_mod = importlib.import_module("workbench.ops.normalization.triton_rmsnorm")
rope_mod = importlib.import_module("workbench.ops.rope.triton_rope")
silu_mod = importlib.import_module("workbench.ops.mlp.triton_silu_mul")
fi_mod = importlib.import_module("workbench.ops.normalization.flashinfer_rmsnorm")

# name -> (x shape, x dtype, weight dtype, strided input)
RMS_CASES = {
    "fp32_h96": ((2, 5, 96), "float32", "float32", False),
    "fp32_2d_pow2": ((7, 64), "float32", "float32", False),
    "fp32_strided": ((3, 4, 48), "float32", "float32", True),
    "fp16": ((2, 5, 96), "float16", "float16", False),
    "bf16": ((2, 5, 96), "bfloat16", "bfloat16", False),
    "bf16_fp32_weight": ((2, 5, 64), "bfloat16", "float32", False),
    "empty_rows": ((0, 64), "float32", "float32", False),
}
# name -> (b, s, n, n_kv, d, unsqueeze_dim, dtype, cos batch 1, q/k strided views of a QKV GEMM)
ROPE_CASES = {
    "bsnd_fp32": (2, 7, 4, 2, 16, 2, "float32", False, False),
    "bsnd_fp32_qkv_views": (2, 7, 4, 2, 16, 2, "float32", False, True),
    "bsnd_fp32_cos_batch1": (3, 5, 9, 3, 64, 2, "float32", True, False),
    "bnsd_fp32": (2, 6, 4, 2, 32, 1, "float32", False, False),
    "bsnd_fp16": (2, 7, 4, 2, 16, 2, "float16", False, False),
    "bsnd_bf16": (2, 7, 4, 2, 16, 2, "bfloat16", False, True),
    "bsnd_d6_odd_heads": (1, 3, 3, 1, 6, 2, "float32", False, False),
}
# name -> (shape, dtype, strided)
SILU_CASES = {
    "fp32": ((2, 5, 128), "float32", False),
    "fp32_wide_strided": ((3, 300), "float32", True),
    "fp16": ((4, 200), "float16", False),
    "bf16": ((2, 3, 64), "bfloat16", False),
}
PIPELINE_RUNS = ["tiny_llama_triton_pipeline", "tiny_mixtral_triton_fusion"]
RUNS = ([f"rmsnorm-{n}" for n in RMS_CASES] + [f"rope-{n}" for n in ROPE_CASES]
        + [f"silu-{n}" for n in SILU_CASES] + ["opcheck", "interpreted"] + PIPELINE_RUNS)


def _close(out, ref, dtype):
    tol = TOLERANCE[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def check_rmsnorm(name: str, device="cpu") -> None:
    shape, dt, wdt, strided = RMS_CASES[name]
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dt)
    full = torch.randn(*shape[:-1], shape[-1] + (16 if strided else 0), generator=g) * 3
    x = full[..., : shape[-1]].to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(getattr(torch, wdt)).to(device)
    _close(wb.triton_rmsnorm(x, w, 1e-6), wb.torch_rmsnorm(x, w, 1e-6), dtype)


def _rope_inputs(name: str, device="cpu"):
    b, s, n, nk, d, dim, dt, cos1, views = ROPE_CASES[name]
    g = torch.Generator().manual_seed(1)
    dtype = getattr(torch, dt)
    if views:  # q/k as the model sees them after fuse_gemms: views of one [b, s, (n+2nk)d] GEMM
        qkv = torch.randn(b, s, (n + 2 * nk) * d, generator=g).to(dtype)
        q, k, _ = qkv.split([n * d, nk * d, nk * d], -1)
        q, k = q.view(b, s, n, d), k.view(b, s, nk, d)
    else:
        q, k = torch.randn(b, s, n, d, generator=g).to(dtype), torch.randn(b, s, nk, d, generator=g).to(dtype)
    if dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cb = 1 if cos1 else b
    cos, sin = torch.randn(cb, s, d, generator=g).to(dtype), torch.randn(cb, s, d, generator=g).to(dtype)
    return [t.to(device) for t in (q, k, cos, sin)] + [dim], dtype


def check_rope(name: str, device="cpu") -> None:
    args, dtype = _rope_inputs(name, device)
    out = wb.triton_rope_with_explicit_cos_sin(*args)
    ref = wb.torch_rope_with_explicit_cos_sin(*args)
    for o, r in zip(out, ref):
        assert o.is_contiguous()
        _close(o, r, dtype)


def check_silu(name: str, device="cpu") -> None:
    shape, dt, strided = SILU_CASES[name]
    g = torch.Generator().manual_seed(2)
    dtype = getattr(torch, dt)
    full = torch.randn(*shape[:-1], shape[-1] + (20 if strided else 0), generator=g) * 3
    x = full[..., : shape[-1]].to(dtype).to(device)
    _close(wb.triton_silu_and_mul(x), wb.torch_silu_and_mul(x), dtype)


# ---------------------------------------------------------------- the child: interpreter cases


def _check_opcheck():
    """Schemas, fake impls (shapes/dtypes/strides equal to the real outputs), no aliasing."""
    x, w = torch.randn(2, 3, 32), torch.rand(32) + 0.5
    torch.library.opcheck(wb.triton_rmsnorm.default, (x, w, 1e-6))
    (q, k, cos, sin, dim), _ = _rope_inputs("bsnd_fp32_qkv_views")
    torch.library.opcheck(wb.triton_rope_with_explicit_cos_sin.default, (q, k, cos, sin, dim))
    torch.library.opcheck(wb.triton_silu_and_mul.default, (torch.randn(4, 64),))
    torch.library.opcheck(wb.torch_silu_and_mul.default, (torch.randn(4, 64),))


def _check_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    for mod in (rms_mod, rope_mod, silu_mod):
        assert isinstance(mod.kernel(), InterpretedFunction), mod.__name__
        assert mod.is_available("cpu")[0]


def _check_tiny_llama_triton_pipeline():
    """The whole default pipeline with every fusion on Triton (interpreted): numerics <= 1e-5
    at every snapshot, the Triton ops in the graph, generation-ready cached graph at the end."""
    from workbench import Workbench

    w = Workbench("tiny:llama", overrides={"fuse_rmsnorm.backend": "triton",
                                           "fuse_rope.backend": "triton", "fuse_swiglu.backend": "triton"})
    w.run()
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= 1e-5, (s.key, s.numerics)
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_rmsnorm"].info.num_matches == 5 and snaps["fuse_rope"].info.num_matches == 2
    assert snaps["fuse_swiglu"].info.num_matches == 2
    hist = w.snapshots[-1].op_histogram
    assert hist["workbench.triton_rmsnorm.default"] == 5
    assert hist["workbench.triton_rope_with_explicit_cos_sin.default"] == 2
    assert hist["workbench.triton_silu_and_mul.default"] == 2
    assert not any(k.startswith("workbench.torch_rmsnorm") for k in hist)


def _check_tiny_mixtral_triton_fusion():
    from workbench import Workbench

    w = Workbench("tiny:mixtral", overrides={"fuse_rmsnorm.backend": "triton", "fuse_rope.backend": "auto"})
    w.run_to("fuse_rope")
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_rmsnorm"].info.num_matches == 5
    # auto never interprets Triton on CPU: it picks the C++ kernel where it builds, else torch
    from workbench.ops import cpu_kernels

    assert snaps["fuse_rope"].info.details["backend"] == ("cpu" if cpu_kernels.load() is None else "torch")
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= 1e-5, (s.key, s.numerics)


def _interpreter_checks() -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the child with TRITON_INTERPRET=1"
    results = {}

    def run(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:  # report every case, not just the first failure
            results[name] = traceback.format_exc()

    for n in RMS_CASES:
        run(f"rmsnorm-{n}", lambda n=n: check_rmsnorm(n))
    for n in ROPE_CASES:
        run(f"rope-{n}", lambda n=n: check_rope(n))
    for n in SILU_CASES:
        run(f"silu-{n}", lambda n=n: check_silu(n))
    run("opcheck", _check_opcheck)
    run("interpreted", _check_interpreted)
    run("tiny_llama_triton_pipeline", _check_tiny_llama_triton_pipeline)
    run("tiny_mixtral_triton_fusion", _check_tiny_mixtral_triton_fusion)
    return results


# ---------------------------------------------------------------- the parent: pytest tests


@pytest.fixture(scope="module")
def interpreter_results():
    if INTERPRETER_SKIP:
        pytest.skip(INTERPRETER_SKIP)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, __file__, "--interpret"], env=env, capture_output=True,
                         text=True, timeout=900)
    lines = res.stdout.strip().splitlines()
    if res.returncode or not lines:
        pytest.fail(f"interpreter child failed (rc={res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("run", RUNS)
def test_interpreter(interpreter_results, run):
    assert interpreter_results[run] == "ok", interpreter_results[run]


@pytest.mark.parametrize("mod", [rms_mod, rope_mod, silu_mod], ids=["rmsnorm", "rope", "silu"])
def test_unavailable_without_interpreter_says_why(mod, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = mod.is_available("cpu")
    assert not ok and "TRITON_INTERPRET" in why
    with pytest.raises(RuntimeError, match="'torch'"):
        if mod is rms_mod:
            wb.triton_rmsnorm(torch.randn(2, 8), torch.ones(8), 1e-6)
        elif mod is rope_mod:
            args, _ = _rope_inputs("bsnd_fp32")
            wb.triton_rope_with_explicit_cos_sin(*args)
        else:
            wb.triton_silu_and_mul(torch.randn(2, 8))


def test_flashinfer_is_available_names_what_is_missing():
    # CPU tensors are refused on every machine; the rest depends on what is installed/visible.
    ok, why = fi_mod.is_available("cpu")
    assert not ok and "FlashInfer kernels need CUDA tensors" in why
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer package is not installed" in why
    with pytest.raises(RuntimeError, match="flashinfer_rmsnorm cannot run"):
        wb.flashinfer_rmsnorm(torch.randn(2, 8).bfloat16(), torch.ones(8).bfloat16(), 1e-6)
    if not torch.cuda.is_available():
        ok, why = fi_mod.is_available()
        assert not ok and "no CUDA GPU is visible" in why


def test_fake_impls_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(2, 3, 8, dtype=torch.bfloat16), torch.empty(8)
        assert wb.triton_rmsnorm(x, w, 1e-6).dtype == torch.float32
        assert wb.flashinfer_rmsnorm(x, w.bfloat16(), 1e-6).shape == (2, 3, 8)
        q, k, cs = torch.empty(2, 5, 4, 16), torch.empty(2, 5, 2, 16), torch.empty(2, 5, 16)
        qo, ko = wb.triton_rope_with_explicit_cos_sin(q, k, cs, cs, 2)
        assert qo.shape == q.shape and ko.shape == k.shape
        assert wb.triton_silu_and_mul(torch.empty(3, 10)).shape == (3, 5)


def _signature(kernel, dtype: str, constexprs: dict, floats=()) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name in floats else "i64"
    return sig


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_kernels_compile_for_hopper(dtype):
    """The interpreter runs kernels as Python and skips the compiler's checks; compile what the
    ops launch on GPUs for sm_90 here, down to a cubin, so a session without a GPU still catches
    what would break on one (SmolLM2 / Llama-3-8B sizes)."""
    import triton
    from triton.runtime.jit import JITFunction

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    if not isinstance(rms_mod.kernel(), JITFunction):
        pytest.skip("kernels were decorated under TRITON_INTERPRET=1 in this process")
    variants = [
        (rms_mod.kernel(), dict(BLOCK=1024), 4, ("eps",)),  # SmolLM2 hidden 576
        (rms_mod.kernel(), dict(BLOCK=4096), 16, ("eps",)),  # Llama-3-8B hidden 4096
        (rope_mod.kernel(), dict(HALF=32, H_PAD=32, N_PAD=16), 4, ()),  # 9 heads, d=64
        (rope_mod.kernel(), dict(HALF=64, H_PAD=64, N_PAD=32), 4, ()),  # 32 heads, d=128
        (silu_mod.kernel(), dict(BLOCK=1024), 4, ()),
    ]
    for kernel, constexprs, warps, floats in variants:
        src = ASTSource(kernel, _signature(kernel, dtype, constexprs, floats), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert compiled.metadata.shared <= 227 * 1024


# ---------------------------------------------------------------- GPU (compiled kernels)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU for the compiled Triton kernels")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(RMS_CASES))
def test_gpu_rmsnorm(name):
    check_rmsnorm(name, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_gpu_rope(name):
    check_rope(name, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(SILU_CASES))
def test_gpu_silu_and_mul(name):
    check_silu(name, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_large_rows_and_cuda_graph():
    """Llama-3-8B sizes, and the ops captured in a CUDA graph (no host syncs inside)."""
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    _close(wb.triton_rmsnorm(x, w, 1e-5), wb.torch_rmsnorm(x, w, 1e-5), torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    wb.triton_rmsnorm(x, w, 1e-5)
    with torch.cuda.graph(g):
        out = wb.triton_rmsnorm(x, w, 1e-5)
    x.normal_()
    g.replay()
    _close(out, wb.torch_rmsnorm(x, w, 1e-5), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not fi_mod.is_available("cuda")[0], reason=fi_mod.is_available("cuda")[1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_flashinfer_rmsnorm(dtype):
    x = torch.randn(3, 5, 576, device="cuda", dtype=dtype)
    w = (torch.rand(576, device="cuda") + 0.5).to(dtype)
    _close(wb.flashinfer_rmsnorm(x, w, 1e-6), wb.torch_rmsnorm(x, w, 1e-6), dtype)


def test_flashinfer_rmsnorm_refuses_fp32_naming_the_backends_that_run():
    """FlashInfer 0.6.18's CUDA norm kernel is half precision only: refused before FlashInfer is
    touched, on any machine."""
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="takes float16 or bfloat16.*'triton' or 'torch'"):
        wb.flashinfer_rmsnorm(x, torch.ones(64), 1e-6)


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_pipeline_uses_triton_backends():
    from workbench import Workbench

    w = Workbench("tiny:llama", device="cuda", dtype="float32")  # the bound below is fp32's
    w.run_to("fuse_rope")
    snaps = {s.key: s for s in w.snapshots}
    assert snaps["fuse_rmsnorm"].info.details["backend"] == "triton"
    assert snaps["fuse_rmsnorm"].info.num_matches == 5 and snaps["fuse_rope"].info.num_matches == 2
    for s in w.snapshots:
        assert s.numerics.ok and s.numerics.rmse_ratio <= 1e-5, (s.key, s.numerics)


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    print(json.dumps(_interpreter_checks()))
