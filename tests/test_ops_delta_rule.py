"""The (gated) delta rule ops: chunked form == token recurrence == HF's torch fallbacks; cached ==
uncached over chunked prefills, mixed decode steps and reused / garbage-filled state slots.

Tolerance: the chunked form and the recurrence sum the same fp32 terms in another order (a
triangular solve and chunk matmuls vs one rank-1 update per token), over sequences of <= 40 tokens
with O(1) values: differences are a few ulps of the outputs, so ``atol = rtol = 1e-5``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import workbench.ops.delta_rule  # noqa: F401
from workbench.ops.delta_rule.delta_rule_math import chunked_delta_rule, prepare, recurrent_delta_rule
from workbench.ops.state import stateful_op_for
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

ops = torch.ops.workbench
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, s, hk, h, dk, dv, seed=0, gated=True, dtype=torch.float32):
    """q/k/v like a real layer's (unnormalised), beta in (0, 1), log decays in [-2, 0]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    g = -2 * torch.rand(b, s, h, generator=gen) if gated else None
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(q), cast(k), cast(v), cast(g), cast(beta)


def _op(q, k, v, g, beta, **opts):
    if g is None:
        return ops.torch_delta_rule(q, k, v, beta, **opts)
    return ops.torch_gated_delta_rule(q, k, v, g, beta, **opts)


def _recurrence(q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    qf, kf, vf, gf, bf = prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    state = vf.new_zeros(vf.shape[0], vf.shape[1], kf.shape[-1], vf.shape[-1])
    return recurrent_delta_rule(qf, kf, vf, gf, bf, state)[0].transpose(1, 2)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("chunk_size,s", [(4, 17), (8, 8), (64, 23), (1, 5)])
def test_chunked_op_equals_recurrence(gated, chunk_size, s):
    # 2 key heads serving 4 value heads (grouped value heads, as in Qwen3-Next), dk != dv
    q, k, v, g, beta = _inputs(2, s, 2, 4, 8, 6, gated=gated)
    # keys normalised by the op, then by the caller (|k| < 1: without that the ungated rule diverges,
    # which is why real layers normalise them) with an explicit q scale
    unit_k = 0.9 * k / k.norm(dim=-1, keepdim=True)
    for keys, opts in ((k, dict(use_qk_l2norm=True)), (unit_k, dict(scale=0.1))):
        out = _op(q, keys, v, g, beta, chunk_size=chunk_size, **opts)
        assert out.shape == (2, s, 4, 6) and out.dtype == q.dtype
        torch.testing.assert_close(out, _recurrence(q, keys, v, g, beta, **opts), **TOL)


def test_chunked_final_state_from_a_given_state_equals_recurrence():
    q, k, v, g, beta = _inputs(1, 21, 2, 2, 8, 8, seed=3)
    qf, kf, vf, gf, bf = prepare(q, k, v, g, beta, None, True)
    start = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(4))
    o_ref, s_ref = recurrent_delta_rule(qf, kf, vf, gf, bf, start)
    o, s = chunked_delta_rule(qf, kf, vf, gf, bf, start, chunk_size=5)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


def test_gated_op_equals_hf_qwen3_next_fallbacks():
    """The op's semantics are HF's: decay before the read, l2norm eps 1e-6, q scaled by dk**-0.5,
    value head j reading key head j // (h / hk). Compared at chunk 64 on 70 tokens (two chunks)."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = _inputs(2, 70, 2, 4, 16, 16, seed=1)
    out = ops.torch_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    # HF's functions take one key head per value head in transformers <= 5.17 (the module repeats them
    # first; later versions accept fewer): give them the repeated heads, which any version reads alike
    qr, kr = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    chunk, _ = hf.torch_chunk_gated_delta_rule(qr, kr, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    recurrent, _ = hf.torch_recurrent_gated_delta_rule(qr, kr, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, chunk, **TOL)
    torch.testing.assert_close(out, recurrent, **TOL)


# ------------------------------------------------------------------------------ cached


def _cached(q, k, v, g, beta, seq_lens, input_pos, slot_idx, num_prefill, state, backend="torch", **opts):
    meta = (*(torch.tensor(x, dtype=torch.int32, device=q.device) for x in (seq_lens, input_pos, slot_idx)),
            num_prefill, state)
    if g is None:
        return getattr(ops, f"{backend}_cached_delta_rule")(q, k, v, beta, *meta, **opts)
    return getattr(ops, f"{backend}_cached_gated_delta_rule")(q, k, v, g, beta, *meta, **opts)


def _run_schedule(seqs, steps, slots, state, backend="torch", **opts):
    """Feed ``seqs`` (name -> (q, k, v, g, beta) of one whole sequence, [1, L, ...]) through the
    cached op, one call per entry of ``steps``: ``(num_prefill, [(name, n_tokens), ...])`` with the
    prefill sequences first. Returns name -> output [L, h, dv]."""
    done = {name: 0 for name in seqs}
    outs = {name: [] for name in seqs}
    for num_prefill, step in steps:
        parts = [[None if t is None else t[:, done[name]:done[name] + n] for t in seqs[name]] for name, n in step]
        flat = [None if parts[0][j] is None else torch.cat([p[j] for p in parts], dim=1) for j in range(5)]
        out = _cached(*flat, [n for _, n in step], [done[name] for name, _ in step],
                      [slots[name] for name, _ in step], num_prefill, state, backend=backend, **opts)
        start = 0
        for name, n in step:
            outs[name].append(out[0, start:start + n])
            done[name] += n
            start += n
    for name, (q, *_rest) in seqs.items():
        assert done[name] == q.shape[1], f"the schedule leaves {name} unfinished"
    return {name: torch.cat(o) for name, o in outs.items()}


@pytest.mark.parametrize("gated", [True, False])
def test_cached_steps_equal_uncached_sequences(gated, backend="torch"):
    """Chunked prefills (a first chunk, then one starting mid-sequence), one-token decodes of
    several sequences in one step, a one-token prompt handled as a decode row, and slots that hold
    garbage (NaN) or a finished sequence's state: every output equals the uncached op on the whole
    sequence, and the slot holds the state after its sequence's last token."""
    # tokens per sequence over the whole schedule (prompt chunks and teacher-forced decode tokens)
    lengths = {"A": 18, "B": 7, "C": 11, "D": 1, "E": 5}
    seqs = {name: _inputs(1, n, 2, 4, 8, 6, seed=10 + i, gated=gated) for i, (name, n) in enumerate(lengths.items())}
    state = torch.full((6, 4, 8, 6), float("nan"))  # 5 sequence slots + the scratch slot, never written before
    slots = {"A": 3, "B": 0, "C": 1, "D": 4, "E": 0}  # E starts after B has finished and reuses its slot
    steps = [
        (2, [("A", 7), ("B", 6)]),            # A's first chunk, B's whole prompt
        (2, [("A", 6), ("C", 5), ("B", 1)]),  # A's second chunk (from input_pos 7), C's first chunk, B decodes
        (1, [("C", 4), ("A", 1), ("D", 1)]),  # C's second chunk; D's one-token prompt as a decode row
        (0, [("A", 1), ("C", 1)]),            # decode only
        (1, [("E", 4), ("A", 1)]),            # E's prompt in B's old slot (which holds B's final state)
        (0, [("A", 1), ("C", 1), ("E", 1)]),
        (0, [("A", 1)]),
    ]
    opts = dict(use_qk_l2norm=True, chunk_size=4)
    got = _run_schedule(seqs, steps, slots, state, backend=backend, **opts)
    for name, (q, k, v, g, beta) in seqs.items():
        torch.testing.assert_close(got[name], _op(q, k, v, g, beta, **opts)[0], **TOL, msg=f"sequence {name}")
    # final states: A's and C's slots hold the recurrence's state after their last token
    for name in ("A", "C", "E"):
        q, k, v, g, beta = seqs[name]
        qf, kf, vf, gf, bf = prepare(q, k, v, g, beta, None, True)
        _, final = recurrent_delta_rule(qf, kf, vf, gf, bf, vf.new_zeros(1, 4, 8, 6))
        torch.testing.assert_close(state[slots[name]], final[0], **TOL, msg=f"state of {name}")


def test_cached_fresh_prefill_is_bitwise_the_uncached_op():
    """A prefill from position 0 runs exactly the uncached computation (the numerics probe of a
    cached graph then reads 0), whatever its slot held."""
    q, k, v, g, beta = _inputs(1, 11, 2, 2, 8, 8, seed=5)
    state = torch.full((3, 2, 8, 8), float("inf"))
    out = _cached(q, k, v, g, beta, [11], [0], [1], 1, state, use_qk_l2norm=True)
    assert torch.equal(out, ops.torch_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True))
    assert torch.isfinite(state[1]).all() and torch.isinf(state[0]).all() and torch.isinf(state[2]).all()


def test_cached_low_precision_inputs_keep_an_fp32_state():
    q, k, v, g, beta = _inputs(1, 9, 2, 2, 8, 8, seed=6, dtype=torch.bfloat16)
    state = torch.zeros(2, 2, 8, 8)
    first = _cached(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], [5], [0], [0], 1, state)
    rest = _cached(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], [4], [5], [0], 1, state)
    assert first.dtype == torch.bfloat16 and state.dtype == torch.float32
    # the same fp32 computation as the uncached op, rounded once to bf16 at the end: equal to 1 bf16 ulp
    ref = ops.torch_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(torch.cat([first, rest], 1), ref, atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------ fakes, errors, registry


def test_fakes_give_the_output_shape_without_computing():
    with FakeTensorMode():
        q, k, v, g, beta = _inputs(3, 7, 2, 4, 8, 6)
        assert ops.torch_gated_delta_rule(q, k, v, g, beta).shape == (3, 7, 4, 6)
        assert ops.torch_delta_rule(q, k, v, beta).shape == (3, 7, 4, 6)
        flat = [t[:1] for t in (q, k, v, g, beta)]
        meta = (torch.tensor([4, 2, 1], dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                torch.zeros(3, dtype=torch.int32), 2, torch.empty(4, 4, 8, 6))
        assert ops.torch_cached_gated_delta_rule(*flat, *meta).shape == (1, 7, 4, 6)
        assert ops.torch_cached_delta_rule(*flat[:3], flat[4], *meta).shape == (1, 7, 4, 6)


@pytest.mark.parametrize("bad,match", [
    (dict(v=torch.randn(1, 5, 3, 6)), "3 value heads is not a multiple of 2"),
    (dict(beta=torch.rand(1, 5, 2)), r"beta \[b, s, value_heads\]"),
    (dict(k=torch.randn(1, 5, 2, 4)), "q and k of one shape"),
    (dict(chunk_size=0), "chunk_size must be >= 1"),
])
def test_bad_arguments_are_named(bad, match):
    q, k, v, g, beta = _inputs(1, 5, 2, 4, 8, 6)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    chunk = bad.pop("chunk_size", 64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ops.torch_gated_delta_rule(*args.values(), chunk_size=chunk)


def test_bad_cached_calls_are_named():
    q, k, v, g, beta = _inputs(1, 5, 2, 4, 8, 6)
    state = torch.zeros(2, 4, 8, 6)
    with pytest.raises(ValueError, match=r"state must be \[num_slots, value_heads, dk, dv\]"):
        _cached(q, k, v, g, beta, [5], [0], [0], 1, torch.zeros(2, 4, 6, 8))
    with pytest.raises(ValueError, match="seq_lens sum to 4 tokens but q has 5"):
        _cached(q, k, v, g, beta, [4], [0], [0], 1, state)
    with pytest.raises(ValueError, match="must be decode steps"):
        _cached(q, k, v, g, beta, [3, 2], [0, 0], [0, 1], 1, state)


def test_stateful_entries_declare_the_state():
    for op, key, name in ((ops.torch_gated_delta_rule, "insert_cached_gated_delta_rule", "gated_delta_state"),
                          (ops.torch_delta_rule, "insert_cached_delta_rule", "delta_state")):
        entry = stateful_op_for(op.default)
        assert entry.insert_key == key and [s.name for s in entry.states] == [name]
        assert entry.states[0].dtype == torch.float32
        q, _, v, _, _ = _inputs(2, 3, 2, 4, 8, 6)
        assert entry.states[0].shape({"q": q, "v": v}) == (4, 8, 6)
        assert entry.cached_op("torch")._schema.name.startswith("workbench::torch_cached_")


# ------------------------------------------------------------------------------ Triton (decode rows)
# ``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, so the interpreter cases run in
# one child process started with it (``python tests/test_ops_delta_rule.py --interpret``), which
# prints {case: "ok" | traceback}; each entry becomes its own pytest result (as test_triton_norm_rope).
# Tolerance: the kernel sums the same fp32 products as the torch decode rows in another order: 1e-5
# as above; bf16 outputs: their own rounding, 1e-2.

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = ["schedule_gated", "schedule_plain", "decode_only_gated", "decode_only_plain_odd_dims",
                "bf16_decode", "deltanet_generate_with_triton_backend"]


def _decode_only_against_torch(gated=True, dk=8, dv=6, dtype=torch.float32, tol=1e-5):
    """A decode-only step (the CUDA-graph path: no host read of the metadata): outputs and every
    state row equal the torch op's; a fresh row (input_pos 0) on a NaN slot ignores the slot."""
    q, k, v, g, beta = _inputs(1, 4, 2, 4, dk, dv, seed=8, gated=gated, dtype=dtype)
    state = torch.randn(6, 4, dk, dv, generator=torch.Generator().manual_seed(9))
    state[2] = float("nan")
    args = ([1, 1, 1, 1], [4, 0, 7, 2], [0, 2, 5, 3], 0)
    ref_state, tri_state = state.clone(), state.clone()
    ref = _cached(q, k, v, g, beta, *args, ref_state, use_qk_l2norm=True)
    out = _cached(q, k, v, g, beta, *args, tri_state, backend="triton", use_qk_l2norm=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(tri_state, ref_state, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.isfinite(tri_state[2]).all() and torch.isnan(tri_state[1]).sum() == 0


def _deltanet_generate_with_triton_backend():
    """tiny:deltanet through the whole pipeline with the Triton cached delta rule: HF's greedy tokens."""
    generate_with_triton_backend_equals_hf("deltanet", "insert_cached_delta_rule", "triton_cached_delta_rule", 4,
                                           new_tokens=6)


def _interpreter_checks() -> dict:
    return {
        "schedule_gated": lambda: test_cached_steps_equal_uncached_sequences(True, backend="triton"),
        "schedule_plain": lambda: test_cached_steps_equal_uncached_sequences(False, backend="triton"),
        "decode_only_gated": _decode_only_against_torch,
        # dk 12 (not a power of two: masked key rows), dv 80 (two value blocks of 64, the second masked)
        "decode_only_plain_odd_dims": lambda: _decode_only_against_torch(False, dk=12, dv=80),
        "bf16_decode": lambda: _decode_only_against_torch(dtype=torch.bfloat16, tol=1e-2),
        "deltanet_generate_with_triton_backend": _deltanet_generate_with_triton_backend,
    }


interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_triton_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta = _inputs(1, 1, 1, 1, 4, 4)
    with pytest.raises(RuntimeError, match=r"insert_cached_gated_delta_rule\.backend=torch"):
        _cached(q, k, v, g, beta, [1], [0], [0], 0, torch.zeros(2, 1, 4, 4), backend="triton")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernel_compiles_for_hopper(dtype):
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 here, at Qwen3-Next
    sizes (dk = dv = 128, two value heads per key head), so a session without a GPU still catches
    what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.delta_rule import triton_delta_rule

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_delta_rule.kernel()
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    for constexprs in (dict(REP=2, DK_POW2=128, BLOCK_V=64, GATED=True, DELTA=True, L2NORM=True, EPS=1e-6),
                       dict(REP=1, DK_POW2=16, BLOCK_V=16, GATED=False, DELTA=True, L2NORM=False, EPS=1e-6)):
        sig = {name: ("constexpr" if name in constexprs else "*i32" if name in ("slot_ptr", "pos_ptr")
                      else "*fp32" if name in ("state_ptr", "g_ptr") else f"*{dtype}" if name.endswith("_ptr")
                      else "fp32" if name == "scale" else "i64") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gated", [True, False])
def test_triton_compiled_on_gpu_equals_torch(gated):
    q, k, v, g, beta = (None if t is None else t.cuda() for t in _inputs(1, 5, 2, 4, 128, 128, seed=2, gated=gated))
    state = torch.randn(7, 4, 128, 128, device="cuda")
    state[3] = float("nan")
    args = ([1] * 5, [4, 0, 7, 2, 1], [0, 3, 5, 2, 6], 0)
    ref_state, tri_state = state.clone(), state.clone()
    ref = _cached(q, k, v, g, beta, *args, ref_state, use_qk_l2norm=True)
    out = _cached(q, k, v, g, beta, *args, tri_state, backend="triton", use_qk_l2norm=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tri_state, ref_state, **TOL)


if __name__ == "__main__":
    child_main(_interpreter_checks)
