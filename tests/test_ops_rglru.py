"""``torch_rglru`` (RecurrentGemma's RG-LRU recurrence) and ``torch_cached_rglru`` (its state-slot form).

Ground truth is the plain recurrence ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) sigmoid(gate_x_t) x_t``
(multiplier 1 and a zero state at a sequence's first token) run token by token
(``rglru_math.rglru_recurrence``). Tolerance: both sides are fp32 sums of decayed terms (each decay
<= 1) computed in another order (the op's log-depth scan vs the loop), so they agree to ~1e-7 of the
output's largest value; checks use 1e-5. The inputs mix short and long memories: ``recurrent_param``
spans softplus^-1(0.01 .. 1), so decays per token range from ~0.9997 to ~0.0003.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

import workbench.ops.rglru  # noqa: F401
from workbench.ops.rglru.rglru_math import rglru_recurrence
from workbench.ops.selective_scan.scan_math import linear_scan
from workbench.ops.state import STATE_METADATA_ARGS, stateful_op_for

rglru = torch.ops.workbench.torch_rglru
cached_rglru = torch.ops.workbench.torch_cached_rglru
REL = 1e-5


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(b, s, w=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sp = torch.exp(torch.empty(w).uniform_(math.log(0.01), math.log(1.0), generator=gen))  # softplus(param)
    return dict(
        x=torch.randn(b, s, w, generator=gen),
        gate_x=torch.randn(b, s, w, generator=gen),
        gate_a=torch.randn(b, s, w, generator=gen),
        recurrent_param=sp + torch.log(-torch.expm1(-sp)),
    )


@pytest.mark.parametrize("s", [1, 2, 7, 33, 130])
def test_rglru_equals_recurrence(s):
    args = _inputs(2, s)
    ref, _ = rglru_recurrence(**args)
    out = rglru(**args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel_err(out, ref) <= REL


def test_first_token_resets_and_state_carries():
    """Token 0 is i * x (multiplier 1, nothing before it); later tokens carry the state: zeroing
    the first half of the inputs changes the last token by far more than round-off."""
    args = _inputs(1, 40, seed=1)
    out = rglru(**args)
    torch.testing.assert_close(out[:, 0], args["x"][:, 0] * torch.sigmoid(args["gate_x"][:, 0]))
    cut = dict(args, x=torch.cat([torch.zeros_like(args["x"][:, :20]), args["x"][:, 20:]], 1))
    assert _rel_err(rglru(**cut)[:, -1], out[:, -1]) > 1e-3


def test_linear_scan_from_an_initial_state():
    gen = torch.Generator().manual_seed(2)
    a, u, h0 = (
        torch.rand(3, 29, 8, generator=gen),
        torch.randn(3, 29, 8, generator=gen),
        torch.randn(3, 8, generator=gen),
    )
    h, want = h0, []
    for t in range(29):
        h = a[:, t] * h + u[:, t]
        want.append(h)
    assert _rel_err(linear_scan(a, u, h0), torch.stack(want, 1)) <= REL


def test_decay_scale_option():
    """``decay_scale`` is Griffin's c: a larger one forgets faster (the recurrence agrees)."""
    args = _inputs(1, 16, seed=3)
    ref, _ = rglru_recurrence(**args, decay_scale=2.0)
    out = rglru(**args, decay_scale=2.0)
    assert _rel_err(out, ref) <= REL and _rel_err(out, rglru(**args)) > 1e-3


def test_bf16_inputs_give_bf16_outputs_rounded_from_fp32():
    args = {k: v.bfloat16() for k, v in _inputs(2, 21, seed=4).items()}
    out = rglru(**args)
    ref = rglru(**{k: v.float() for k, v in args.items()})
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


def test_bad_shapes_are_refused_with_the_argument_named():
    args = _inputs(1, 5)
    with pytest.raises(ValueError, match="gate_a"):
        rglru(**dict(args, gate_a=args["gate_a"][..., :3]))
    with pytest.raises(ValueError, match="recurrent_param"):
        rglru(**dict(args, recurrent_param=args["recurrent_param"][:2]))
    with pytest.raises(ValueError, match="x \\[b, s, width\\]"):
        rglru(**{k: (v[0] if k != "recurrent_param" else v) for k, v in args.items()})


# ------------------------------------------------------------------------------------- cached op
TOKEN_ARGS = ("x", "gate_x", "gate_a")


def _step(args, state, rows, slots, num_prefill, op=None):
    """One cached step of ``op`` (default: the torch reference) over ``rows = [(sequence, start,
    end), ...]`` (prefill sequences first); returns per-row outputs."""
    flat = {k: torch.cat([args[k][i, a:e] for i, a, e in rows])[None] for k in TOKEN_ARGS}
    seq_lens = torch.tensor([e - a for _, a, e in rows], dtype=torch.int32)
    input_pos = torch.tensor([a for _, a, _ in rows], dtype=torch.int32)
    slot_idx = torch.tensor(slots, dtype=torch.int32)
    y = (op or cached_rglru)(
        flat["x"],
        flat["gate_x"],
        flat["gate_a"],
        args["recurrent_param"],
        seq_lens,
        input_pos,
        slot_idx,
        num_prefill,
        state,
    )
    assert y.shape == flat["x"].shape
    return list(torch.split(y[0], seq_lens.tolist()))


def check_schedule(op=None, w=24) -> None:
    """Three sequences (40, 24 and 9 tokens) in their own slots of a garbage-filled (NaN) state:
    first prefill chunks; then sequence 0's second chunk (chunked prefill from its slot) next to
    decode rows of the others; then mixed decode steps until all are done. Every token's output
    equals the uncached op on the whole sequence, every slot ends in the recurrence's final state,
    and the slots no sequence owns are left alone."""
    lens = [40, 24, 9]
    args = _inputs(3, 40, w=w, seed=5)
    ref = rglru(**args)
    state = torch.full((6, w), float("nan"))
    slots = [3, 0, 4]
    pieces: dict = {i: [] for i in range(3)}

    def run(rows, num_prefill):
        for (i, _, _), y in zip(rows, _step(args, state, rows, [slots[i] for i, _, _ in rows], num_prefill, op)):
            pieces[i].append(y)

    run([(0, 0, 16), (1, 0, 20), (2, 0, 5)], 3)
    run([(0, 16, 37), (1, 20, 21), (2, 5, 6)], 1)
    pos = {0: 37, 1: 21, 2: 6}
    while any(pos[i] < lens[i] for i in range(3)):
        live = [i for i in range(3) if pos[i] < lens[i]]
        run([(i, pos[i], pos[i] + 1) for i in live], 0)
        for i in live:
            pos[i] += 1
    for i, length in enumerate(lens):
        out = torch.cat(pieces[i])
        truth, final = rglru_recurrence(**{k: (v[i : i + 1, :length] if v.dim() > 1 else v) for k, v in args.items()})
        assert _rel_err(out, ref[i, :length]) <= REL and _rel_err(out, truth[0]) <= REL, i
        assert _rel_err(state[slots[i]], final[0]) <= REL, i
    assert torch.isnan(state[[1, 2, 5]]).all()


def test_cached_matches_uncached_over_chunked_prefill_and_mixed_decode():
    check_schedule()


def test_new_sequence_in_a_reused_slot_starts_from_zero():
    """A slot holding another sequence's (finite) state: input_pos 0 ignores it and resets (the
    first token's multiplier is 1), for a prefill and a one-token decode row alike; input_pos > 0
    continues from it."""
    args = _inputs(2, 10, seed=6)
    state = torch.randn(3, 24)
    fresh = rglru(**args)
    y_prefill, y_decode = _step(args, state, [(0, 0, 10), (1, 0, 1)], [1, 0], num_prefill=1)
    assert _rel_err(y_prefill, fresh[0]) <= REL and _rel_err(y_decode, fresh[1, :1]) <= REL
    held = state[:1].clone()
    (y_continued,) = _step(args, state, [(1, 1, 2)], [0], num_prefill=0)
    want, _ = rglru_recurrence(**{k: (v[1:, 1:2] if v.dim() > 1 else v) for k, v in args.items()}, initial_state=held)
    assert _rel_err(y_continued, want[0]) <= REL


def test_cached_op_refuses_inconsistent_metadata():
    args = _inputs(1, 4)
    state = torch.zeros(2, 24)
    call = (args["x"], args["gate_x"], args["gate_a"], args["recurrent_param"])

    def i32(*v):
        return torch.tensor(v, dtype=torch.int32)

    with pytest.raises(ValueError, match="seq_lens sum"):
        cached_rglru(*call, i32(3), i32(0), i32(0), 1, state)
    with pytest.raises(ValueError, match="decode steps"):
        cached_rglru(*call, i32(2, 2), i32(0, 0), i32(0, 1), 1, state)
    with pytest.raises(ValueError, match="slot_idx"):
        cached_rglru(*call, i32(4), i32(0), i32(0, 1), 1, state)
    with pytest.raises(ValueError, match="rglru_state must be"):
        cached_rglru(*call, i32(4), i32(0), i32(0), 1, state[:, :8])


def test_stateful_entry_matches_the_cached_schema():
    """The entry the cache stage reads: the cached op takes the uncached op's positional args, then
    the metadata, then the fp32 state [width], and the same keyword options; key
    insert_cached_ssm_attention."""
    entry = stateful_op_for(rglru.default)
    assert entry is not None and entry.insert_key == "insert_cached_ssm_attention"
    src = rglru.default._schema
    positional = [a.name for a in src.arguments if not a.kwarg_only]
    options = [(a.name, str(a.type), a.default_value) for a in src.arguments if a.kwarg_only]
    for backend in ("torch", "triton"):
        dst = entry.cached_op(backend)._schema
        assert [a.name for a in dst.arguments if not a.kwarg_only] == positional + list(STATE_METADATA_ARGS) + [
            "rglru_state"
        ]
        assert [(a.name, str(a.type), a.default_value) for a in dst.arguments if a.kwarg_only] == options
    assert set(entry.token_args) == set(TOKEN_ARGS)
    (spec,) = entry.states
    assert spec.name == "rglru_state" and spec.dtype == torch.float32 and spec.shape(_inputs(2, 3, w=40)) == (40,)


# ------------------------------------------------------------------------ Triton (decode rows)
# Interpreter cases run in one child process started with TRITON_INTERPRET=1 (tests/triton_child.py).
# Tolerance: the kernel computes the same fp32 formulas as the torch decode rows (its sigmoid,
# softplus and exp may differ by an ulp): REL; bf16 outputs: one bf16 ulp (2^-7 relative).

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = [
    "schedule",
    "schedule_two_channel_blocks",
    "decode_only_matches_torch",
    "bf16_decode",
    "recurrent_gemma_generate_with_triton_backend",
]


def _decode_only_against_torch(dtype=torch.float32, w=300):
    """A decode-only step (no host read of the metadata; width 300 = two channel blocks): outputs
    and state rows equal the torch op's; a fresh row (input_pos 0) on a NaN slot ignores the slot;
    slots no row owns are untouched."""
    args = {k: v.to(dtype) for k, v in _inputs(3, 1, w=w, seed=8).items()}
    flat = {k: args[k].reshape(1, 3, w) for k in TOKEN_ARGS}
    state = torch.randn(6, w)
    state[2] = float("nan")
    meta = (
        torch.ones(3, dtype=torch.int32),
        torch.tensor([4, 0, 7], dtype=torch.int32),
        torch.tensor([0, 2, 5], dtype=torch.int32),
    )
    ref_state, tri_state = state.clone(), state.clone()
    call = (flat["x"], flat["gate_x"], flat["gate_a"], args["recurrent_param"])
    ref = cached_rglru(*call, *meta, 0, ref_state)
    out = torch.ops.workbench.triton_cached_rglru(*call, *meta, 0, tri_state)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(out, ref) <= REL
    else:
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    assert _rel_err(tri_state[[0, 2, 5]], ref_state[[0, 2, 5]]) <= REL
    assert torch.isfinite(tri_state[2]).all()
    torch.testing.assert_close(tri_state[[1, 3, 4]], state[[1, 3, 4]], rtol=0, atol=0)


def _interpreter_checks() -> dict:
    triton_op = torch.ops.workbench.triton_cached_rglru
    return {
        "schedule": lambda: check_schedule(triton_op),
        "schedule_two_channel_blocks": lambda: check_schedule(triton_op, w=300),
        "decode_only_matches_torch": _decode_only_against_torch,
        "bf16_decode": lambda: _decode_only_against_torch(torch.bfloat16),
        "recurrent_gemma_generate_with_triton_backend": lambda: generate_with_triton_backend_equals_hf(
            "recurrent_gemma",
            "insert_cached_ssm_attention",
            "triton_cached_rglru",
            2,
            prompt_lens=(5, 21),
            new_tokens=6,
        ),
    }


interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_triton_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _inputs(1, 1)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="insert_cached_ssm_attention.backend=torch"):
        torch.ops.workbench.triton_cached_rglru(*args.values(), one, one, one * 0, 0, torch.zeros(2, 24))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_compiles_for_hopper():
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 here (fp32 and
    bf16 activations), so a session without a GPU still catches what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.rglru import triton_rglru

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_rglru.kernel()
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    for dtype in ("fp32", "bf16"):
        sig = {}
        for name in kernel.arg_names:
            if name == "BLOCK":
                sig[name] = "constexpr"
            elif name in ("slot_ptr", "pos_ptr"):
                sig[name] = "*i32"
            elif name == "state_ptr":
                sig[name] = "*fp32"
            elif name.endswith("_ptr"):
                sig[name] = f"*{dtype}"
            elif name == "decay_scale":
                sig[name] = "fp32"
            else:
                sig[name] = "i64"
        compiled = triton.compile(
            ASTSource(kernel, sig, constexprs={"BLOCK": 256}),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4),
        )
        assert compiled.metadata.shared <= 227 * 1024


if __name__ == "__main__":
    child_main(_interpreter_checks)
