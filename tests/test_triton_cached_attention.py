"""``workbench::triton_cached_attention`` (paged KV cache, Triton) against a plain-loop reference.

Why the kernels run in a child process: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is
decorated, and setting it in this pytest process would switch every other Triton op of the run
(the MoE routing op, say) to the interpreter too. So one child, started with
``TRITON_INTERPRET=1`` as ``python tests/test_triton_cached_attention.py --interpret``, runs every
interpreter case on CPU tensors and prints one JSON line {run: "ok" | "skip: why" | traceback};
``test_interpreter`` turns each entry into its own pytest result. The child also checks that the
kernels really are interpreted (``InterpretedFunction``) and that everything stays on the CPU.

``test_kernels_compile_for_hopper`` compiles the GPU variants ahead of time on this CPU machine.
GPU tests (``@pytest.mark.gpu``) run the same cases compiled on CUDA in fp32/fp16/bf16, plus
longer contexts with the default split-K choice and a CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import traceback
from typing import Optional, Tuple

import pytest
import torch
from triton_child import INTERPRETER_SKIP

import workbench.ops  # noqa: F401  (registers the canonical ops)
# import_module, not `from ... import`: once the package re-exports the op under the same name,
# the package attribute is the op, not this module.
tca = importlib.import_module("workbench.ops.attention.triton_cached_attention")

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclasses.dataclass(frozen=True)
class Case:
    """One mixed batch: the first ``num_prefill`` sequences prefill, the rest decode."""

    seq_lens: Tuple[int, ...]
    input_pos: Tuple[int, ...]
    num_prefill: int
    hq: int = 9
    hkv: int = 3
    d: int = 16
    page_size: int = 16
    window: Optional[int] = None
    cap: Optional[float] = None
    sinks: bool = False
    scale: Optional[float] = None  # None: 1/sqrt(d)
    num_splits: Optional[int] = None  # forced decode split-K; None: the device default


# Tiny on purpose (the interpreter runs each program in numpy). Interpreter tiles are 16 rows and
# 16 keys, so sequences of 17-40 tokens cross tiles, key blocks and 16-slot pages.
CASES = {
    # 2 prefill (one chunked: 6 new tokens after 21 cached) + 3 decode, SmolLM2's 9/3 heads.
    "mixed_gqa9_3": Case((37, 6, 1, 1, 1), (0, 21, 40, 15, 3), 2),
    # 4/2 heads, window 8, 8-slot pages (key blocks span two pages), decode split in 3.
    "mixed_gqa4_2_window_split3": Case((20, 9, 1, 1, 1), (0, 30, 50, 7, 33), 2, hq=4, hkv=2,
                                       d=32, page_size=8, window=8, num_splits=3),
    # Logits of std ~2 against a cap of 1.5, so the cap bites; per-head sinks.
    "softcap_sinks": Case((19, 4, 1, 1), (0, 13, 29, 2), 2, cap=1.5, scale=0.5, sinks=True),
    # Everything at once, with the sink carried through a split decode.
    "window_cap_sinks_split2": Case((25, 3, 1, 1), (5, 40, 60, 16), 2, hq=4, hkv=2, window=12,
                                    cap=2.0, sinks=True, num_splits=2),
    "prefill_only": Case((17, 33, 2), (0, 0, 47), 3),
    # Position 0 has one key: splits 1..3 are empty and must drop out of the merge.
    "decode_only_split4": Case((1, 1, 1, 1), (0, 15, 16, 70), 0, hq=4, hkv=2, num_splits=4),
    "smollm2_d64": Case((18, 1, 1), (0, 33, 5), 1, d=64),
}
# (case, dtype) pairs the interpreter runs; every case in fp32, the feature-heavy ones in half.
INTERPRETER_RUNS = [(name, "float32") for name in CASES] + [
    ("mixed_gqa9_3", "float16"), ("window_cap_sinks_split2", "float16"),
    ("mixed_gqa9_3", "bfloat16"),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_inputs(case: Case, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict:
    """Op arguments for ``case``: shuffled, non-contiguous page ids; cached positions hold random
    rows and every other cache slot NaN, with unused page-table entries pointing at an all-NaN
    page, so any read outside the visible keys turns the output into NaN."""
    g = torch.Generator().manual_seed(seed)
    b, t, ps = len(case.seq_lens), sum(case.seq_lens), case.page_size

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = randn(1, t, case.hq, case.d), randn(1, t, case.hkv, case.d), randn(1, t, case.hkv, case.d)
    need = [-(-(p + n) // ps) for n, p in zip(case.seq_lens, case.input_pos)]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=g)
    poison = int(perm[-1])
    page_table = torch.full((b, max(need) + 1), poison, dtype=torch.int32)
    k_cache = torch.full((num_pages, ps, case.hkv, case.d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    used = 0
    for i, (n_pages, ctx) in enumerate(zip(need, case.input_pos)):
        page_table[i, :n_pages] = perm[used:used + n_pages]
        used += n_pages
        for pos in range(ctx):
            page, slot = page_table[i, pos // ps], pos % ps
            k_cache[page, slot] = randn(case.hkv, case.d)
            v_cache[page, slot] = randn(case.hkv, case.d)
    args = dict(
        q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32),
        input_pos=torch.tensor(case.input_pos, dtype=torch.int32), page_table=page_table,
        num_prefill=case.num_prefill,
        scale=case.scale if case.scale is not None else 1 / math.sqrt(case.d),
        sliding_window=case.window, logit_cap=case.cap,
        sinks=randn(case.hq) if case.sinks else None,
    )
    return {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in args.items()}


def reference_cached_attention(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table,
                               num_prefill, scale, sliding_window=None, logit_cap=None, sinks=None):
    """The op's semantics as plain loops over sequences, query rows and heads, in float64.

    Returns (out [1, T, Hq, D] in q's dtype, k_cache, v_cache) with the caches as new tensors.
    ``num_prefill`` changes nothing here: decode is a one-token sequence like any other.
    """
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    ps, hq, group = k_cache.shape[1], q.shape[2], q.shape[2] // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for i, (n, ctx) in enumerate(zip(seq_lens.tolist(), input_pos.tolist())):
        for j in range(n):
            pos = ctx + j
            page, slot = int(page_table[i, pos // ps]), pos % ps
            k_cache[page, slot] = k[0, start + j]
            v_cache[page, slot] = v[0, start + j]
        positions = range(ctx + n)
        pages = page_table[i, [p // ps for p in positions]].long()
        slots = torch.tensor([p % ps for p in positions], device=q.device)
        keys, vals = k_cache[pages, slots].double(), v_cache[pages, slots].double()  # [L, Hkv, D]
        for j in range(n):
            pos = ctx + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(hq):
                logits = keys[lo:pos + 1, h // group] @ q[0, start + j, h].double() * scale
                if logit_cap is not None:
                    logits = logit_cap * torch.tanh(logits / logit_cap)
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h:h + 1].double()])
                probs = torch.softmax(logits, 0)[: pos + 1 - lo]  # the sink has no value
                out[0, start + j, h] = probs @ vals[lo:pos + 1, h // group]
        start += n
    return out.to(q.dtype), k_cache, v_cache


def check_case(case: Case, dtype: torch.dtype, device="cpu") -> None:
    """Kernel vs reference: the output, and the caches after the write (bit-exact)."""
    args = make_inputs(case, dtype, device)
    ref_out, ref_k, ref_v = reference_cached_attention(**args)
    out = tca.cached_attention_forward(**args, num_splits=case.num_splits)
    assert out.device == args["q"].device and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(args["k_cache"], ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(args["v_cache"], ref_v, atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------- the child: interpreter cases


def _interpreter_checks() -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the child with TRITON_INTERPRET=1"
    from triton.runtime.interpreter import InterpretedFunction

    from workbench.ops.attention.triton_kernels import (paged_decode, paged_kv_append,
                                                        paged_prefill)

    results = {}
    for kernel in (paged_kv_append.paged_kv_append_kernel, paged_prefill.paged_prefill_kernel,
                   paged_decode.paged_decode_kernel, paged_decode.paged_decode_reduce_kernel):
        assert isinstance(kernel, InterpretedFunction), f"{kernel} is compiled, not interpreted"
    assert tca.is_available("cpu")[0]

    def run(name, fn):
        try:
            results[name] = fn() or "ok"
        except Exception:  # report every case, not just the first failure
            results[name] = traceback.format_exc()

    for name, dtype in INTERPRETER_RUNS:
        run(f"{name}-{dtype}", lambda: check_case(CASES[name], getattr(torch, dtype)))
    run("op_entry_point", _check_op_entry_point)
    run("opcheck", _check_opcheck)
    run("vs_torch_cached_attention", _check_vs_torch_cached_attention)
    return results


def _check_op_entry_point():
    """The registered op (default split choice) writes the caches in place and matches."""
    args = make_inputs(CASES["mixed_gqa9_3"], torch.float32)
    ref_out, ref_k, _ = reference_cached_attention(**args)
    out = torch.ops.workbench.triton_cached_attention(**args)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(args["k_cache"], ref_k, atol=0, rtol=0, equal_nan=True)


def _check_opcheck():
    """Schema (declared mutations are the real ones), fake impl, autograd registration."""
    args = make_inputs(Case((3, 1), (2, 5), 1, hq=4, hkv=2), torch.float32)
    # NaN cache slots would make the repeated-run comparisons fail on NaN != NaN.
    args["k_cache"].nan_to_num_(0.0)
    args["v_cache"].nan_to_num_(0.0)
    names = ["q", "k", "v", "k_cache", "v_cache", "seq_lens", "input_pos", "page_table",
             "num_prefill", "scale"]
    torch.library.opcheck(torch.ops.workbench.triton_cached_attention.default,
                          tuple(args[n] for n in names))


def _check_vs_torch_cached_attention():
    """Same inputs through the parallel torch reference op, when it exists."""
    if not hasattr(torch.ops.workbench, "torch_cached_attention"):
        return "skip: torch.ops.workbench.torch_cached_attention is not registered yet"
    case = CASES["window_cap_sinks_split2"]
    mine, theirs = make_inputs(case, torch.float32), make_inputs(case, torch.float32)
    out = torch.ops.workbench.triton_cached_attention(**mine)
    ref = torch.ops.workbench.torch_cached_attention(**theirs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine["k_cache"], theirs["k_cache"], atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------- the parent: pytest tests


@pytest.fixture(scope="module")
def interpreter_results():
    if INTERPRETER_SKIP:
        pytest.skip(INTERPRETER_SKIP)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, __file__, "--interpret"], env=env, capture_output=True,
                         text=True, timeout=600)
    lines = res.stdout.strip().splitlines()
    if res.returncode or not lines:
        pytest.fail(f"interpreter child failed (rc={res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("run", [f"{n}-{d}" for n, d in INTERPRETER_RUNS]
                         + ["op_entry_point", "opcheck", "vs_torch_cached_attention"])
def test_interpreter(interpreter_results, run):
    result = interpreter_results[run]
    if result.startswith("skip: "):
        pytest.skip(result[len("skip: "):])
    assert result == "ok", result


@pytest.mark.parametrize("window,cap,sinks", [(None, None, False), (5, 1.0, True)])
@pytest.mark.parametrize("ctx", [0, 7])
def test_reference_matches_torch_attention(window, cap, sinks, ctx):
    """The loop reference agrees with the canonical dense op on one sequence whose first ``ctx``
    tokens are already cached (torch_attention aligns causal masks bottom-right, like a cache)."""
    case = Case((11,), (ctx,), 1, hq=4, hkv=2, d=8, page_size=4, window=window, cap=cap,
                sinks=sinks)
    args = make_inputs(case, torch.float32)
    out, k_cache, v_cache = reference_cached_attention(**args)
    pages = args["page_table"][0, [p // 4 for p in range(ctx + 11)]].long()
    slots = torch.arange(ctx + 11) % 4
    keys, vals = k_cache[pages, slots][None], v_cache[pages, slots][None]  # [1, s_k, Hkv, D]
    dense = torch.ops.workbench.torch_attention(
        args["q"], keys, vals, is_causal=True, scale=args["scale"], sinks=args["sinks"],
        sliding_window=window, logit_cap=cap, layout="bsnd")
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = tca.is_available("cpu")
    assert not ok and "TRITON_INTERPRET" in why
    args = make_inputs(Case((2, 1), (0, 3), 1, hq=4, hkv=2), torch.float32)
    with pytest.raises(RuntimeError, match="backend 'torch'"):
        torch.ops.workbench.triton_cached_attention(**args)


@pytest.mark.parametrize("change,message", [
    (dict(k=torch.zeros(1, 3, 3, 16), v=torch.zeros(1, 3, 3, 16)), "query heads is not a multiple"),
    (dict(seq_lens=torch.tensor([2, 1])), "seq_lens must be int32"),
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(sinks=torch.zeros(3)), "sinks must be"),
])
def test_bad_arguments_are_named(change, message):
    args = make_inputs(Case((2, 1), (0, 3), 1, hq=4, hkv=2), torch.float32)
    args.update(change)
    from workbench.ops.attention.cached_attention_schema import CachedAttentionArgs

    with pytest.raises(ValueError, match=message):
        tca._check(CachedAttentionArgs(**args))


def test_fake_impl_gives_q_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_inputs(Case((5, 1), (0, 9), 1), torch.float16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {n: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
        out = torch.ops.workbench.triton_cached_attention(**fake)
    assert out.shape == args["q"].shape and out.dtype == torch.float16


def test_bench_exits_cleanly_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would really run")
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "attention_kernels.py")
    res = subprocess.run([sys.executable, bench], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "needs a CUDA GPU" in res.stdout, res.stdout + res.stderr


_INT_POINTERS = {"cu_seqlens_ptr", "input_pos_ptr", "page_table_ptr", "tile_seq_ptr",
                 "tile_start_ptr", "token_seq_ptr", "seq_lens_ptr"}


# Tuple arguments: (scale, window, cap), and the strides of (q, out, k_cache, v_cache) with the
# page table's row stride ((k, v, k_cache, v_cache, page table) for the write kernel).
_STRIDES = (("i32",) * 3, ("i32",) * 3, ("i32",) * 4, ("i32",) * 4, "i32")
_TUPLES = {"scalars": ("fp32", "i32", "fp32", "i32"), "strides": _STRIDES}  # scale, window, cap, chunk


def _aot_signature(kernel, dtype: str, constexprs: dict) -> dict:
    """Triton signature strings from the kernel's argument names (our naming convention)."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _INT_POINTERS:
            sig[name] = "*i32"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in _TUPLES:
            sig[name] = _TUPLES[name]
        else:
            sig[name] = "fp32" if name in ("scale", "cap") else "i32"
    return sig


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_hopper():
    """The interpreter runs kernels as Python and skips the compiler's checks (static typing of
    loop-carried values and branches, constexpr-only constructs, dot operand dtypes, shared
    memory), so compile the variants the op launches on GPUs for sm_90 here, down to a cubin with
    the ptxas triton ships: a session without a GPU still catches what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    from workbench.ops.attention.triton_kernels import (paged_decode, paged_kv_append,
                                                        paged_prefill)

    if not isinstance(paged_prefill.paged_prefill_kernel, JITFunction):
        pytest.skip("kernels were decorated under TRITON_INTERPRET=1 in this process")
    blocks = tca._block_sizes(torch.device("cuda"), 64)
    shared = dict(PAGE_SIZE=16, HEAD_DIM=64, D_PAD=64, HAS_WINDOW=True, HAS_CAP=True,
                  HAS_SINKS=True, HAS_ALIBI=True, HAS_CHUNK=True)
    variants = [
        (paged_kv_append.paged_kv_append_kernel, "fp16",
         dict(NUM_KV_HEADS=3, H_PAD=4, K_DIM=64, K_PAD=64, V_DIM=64, V_PAD=64, B_PAD=8, PAGE_SIZE=16)),
        # triton_cached_mla's latent cache at DeepSeek-V2's sizes: one head, latent r = 512 as K,
        # rope key dr = 64 as V
        (paged_kv_append.paged_kv_append_kernel, "bf16",
         dict(NUM_KV_HEADS=1, H_PAD=1, K_DIM=512, K_PAD=512, V_DIM=64, V_PAD=64, B_PAD=64, PAGE_SIZE=64)),
        # ... in an fp32 cache, and at tiny:deepseek_v2's sizes (r = 32, dr = 8)
        (paged_kv_append.paged_kv_append_kernel, "fp32",
         dict(NUM_KV_HEADS=1, H_PAD=1, K_DIM=512, K_PAD=512, V_DIM=64, V_PAD=64, B_PAD=64, PAGE_SIZE=64)),
        (paged_kv_append.paged_kv_append_kernel, "fp32",
         dict(NUM_KV_HEADS=1, H_PAD=1, K_DIM=32, K_PAD=32, V_DIM=8, V_PAD=8, B_PAD=64, PAGE_SIZE=64)),
        (paged_decode.paged_decode_reduce_kernel, "fp16",
         dict(HEAD_DIM=64, D_PAD=64, NUM_SPLITS=8, S_PAD=8)),
    ]
    for dtype in ("fp16", "fp32"):  # bf16 takes the fp16 path; fp32 the FP32_DOT one
        flags = dict(shared, GROUP=3, FP32_DOT=dtype == "fp32")
        variants.append((paged_prefill.paged_prefill_kernel, dtype,
                         dict(flags, BLOCK_M=blocks["prefill_m"], BLOCK_N=blocks["prefill_n"])))
        for splits in (1, 8):
            variants.append((paged_decode.paged_decode_kernel, dtype,
                             dict(flags, G_PAD=16, BLOCK_N=blocks["decode_n"], NUM_SPLITS=splits)))
    # a chunk without a window: the key range starts from a plain 0, not a window's tensor
    flags = dict(shared, GROUP=3, FP32_DOT=False, HAS_WINDOW=False)
    variants.append((paged_prefill.paged_prefill_kernel, "fp16",
                     dict(flags, BLOCK_M=blocks["prefill_m"], BLOCK_N=blocks["prefill_n"])))
    variants.append((paged_decode.paged_decode_kernel, "fp16",
                     dict(flags, G_PAD=16, BLOCK_N=blocks["decode_n"], NUM_SPLITS=1)))
    for kernel, dtype, constexprs in variants:
        src = ASTSource(kernel, _aot_signature(kernel, dtype, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=blocks["num_warps"]))
        assert compiled.metadata.shared <= 227 * 1024, (kernel, constexprs)


# ---------------------------------------------------------------- GPU (compiled kernels)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU for the compiled Triton kernels")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_cases(name, dtype):
    check_case(CASES[name], dtype, device="cuda")


def _check_on_gpu_against_cpu_reference(case: Case, dtype: torch.dtype) -> None:
    args = make_inputs(case, dtype, device="cuda")
    cpu_args = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    ref_out, ref_k, _ = reference_cached_attention(**cpu_args)
    out = torch.ops.workbench.triton_cached_attention(**args)  # default split-K choice
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(args["k_cache"].cpu(), ref_k, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_context_default_splits(dtype):
    """GPU block sizes (64) and the SM-based split-K choice on contexts of hundreds of tokens."""
    case = Case((150, 70, 1, 1, 1), (0, 300, 700, 129, 1000), 2, d=64, window=None)
    _check_on_gpu_against_cpu_reference(case, dtype)
    _check_on_gpu_against_cpu_reference(dataclasses.replace(case, window=200, sinks=True), dtype)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_positions():
    """No host sync inside the op: it captures into a CUDA graph, and a replay after the
    positions/page table change in place computes the new step correctly."""
    case = Case((1, 1, 1), (40, 7, 90), 0, d=64)
    args = make_inputs(case, torch.float16, device="cuda")
    args["k_cache"].nan_to_num_(0.0)
    args["v_cache"].nan_to_num_(0.0)
    op = torch.ops.workbench.triton_cached_attention
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(**args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(**args)
    args["input_pos"].copy_(torch.tensor([41, 8, 91], dtype=torch.int32))
    args["q"].normal_()
    before = {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    graph.replay()
    cpu = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in before.items()}
    ref_out, ref_k, _ = reference_cached_attention(**cpu)
    torch.testing.assert_close(out.cpu(), ref_out, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(args["k_cache"].cpu(), ref_k, atol=0, rtol=0)


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    print(json.dumps(_interpreter_checks()))
