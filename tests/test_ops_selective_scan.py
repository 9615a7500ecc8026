"""``torch_selective_scan`` (the Mamba-1 scan) and ``torch_cached_selective_scan`` (its state-slot form).

Ground truth is the plain recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = h_t C_t +
D x_t`` run token by token (``scan_math.selective_recurrence``). Tolerance: both sides are fp32 sums
of at most a few dozen terms of magnitude <= ~50 (each decay <= 1), computed in another order (the
chunked parallel scan composes decays by products), so they agree to ~1e-7 of the output's largest
value (observed); checks use 1e-5 relative. Sizes are tiny (d = 12 channels, state 16) and chunk
sizes small so that every sequence spans several chunks.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

import workbench.ops.selective_scan  # noqa: F401
from workbench.ops.selective_scan.scan_math import discretize, selective_recurrence, selective_scan_chunked
from workbench.ops.state import STATE_METADATA_ARGS, stateful_op_for

scan = torch.ops.workbench.torch_selective_scan
cached_scan = torch.ops.workbench.torch_cached_selective_scan
REL = 1e-5


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(b, s, d=12, n=16, seed=0):
    """Scan arguments with short and long memories: -A in [0.25, 16] (Mamba's 1..n range, widened),
    steps around softplus(-5 .. 0) so some channels forget within a token and some carry state for
    the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(b, s, d, generator=gen),
        A=-torch.exp(torch.empty(d, n).uniform_(math.log(0.25), math.log(16.0), generator=gen)),
        B=torch.randn(b, s, n, generator=gen),
        C=torch.randn(b, s, n, generator=gen),
        D=torch.randn(d, generator=gen),
        dt=torch.randn(b, s, d, generator=gen),
        dt_bias=torch.empty(d).uniform_(-5.0, 0.0, generator=gen),
    )


def _recurrence(args, initial_state=None):
    """(y [b, s, d], final state [b, d, n]) by the token-by-token definition, D skip included."""
    x = args["hidden_states"].float()
    step = discretize(args["dt"], args["dt_bias"])
    y, state = selective_recurrence(x, step, args["A"], args["B"], args["C"], initial_state)
    return y + args["D"] * x, state


@pytest.mark.parametrize("s, chunk", [(1, 8), (7, 8), (8, 8), (45, 8), (45, 16), (45, 64), (33, 1)])
def test_selective_scan_equals_recurrence(s, chunk):
    args = _inputs(2, s)
    ref, _ = _recurrence(args)
    out = scan(**args, chunk_size=chunk)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel_err(out, ref) <= REL


def test_chunked_scan_carries_initial_and_final_state():
    """The chunked core from a non-zero state (what a chunked prefill needs) ends in the
    recurrence's state, also when the last chunk is partial."""
    args = _inputs(2, 29, seed=3)
    init = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(9))
    step = discretize(args["dt"], args["dt_bias"])
    ins = (args["hidden_states"], step, args["A"], args["B"], args["C"])
    y, final = selective_scan_chunked(*ins, 8, initial_state=init)
    y_ref, final_ref = selective_recurrence(*ins, initial_state=init)
    assert _rel_err(y, y_ref) <= REL and _rel_err(final, final_ref) <= REL


def test_bf16_inputs_give_bf16_outputs_rounded_from_fp32():
    """The scan runs in fp32 whatever the input dtype: a bf16 call equals the fp32 call on the
    same (bf16-representable) values, rounded once to bf16 (relative step 2^-8)."""
    args = {k: v.bfloat16() for k, v in _inputs(2, 21, seed=4).items()}
    out = scan(**args, chunk_size=8)
    ref = scan(**{k: v.float() for k, v in args.items()}, chunk_size=8)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


def test_bad_shapes_are_refused_with_the_argument_named():
    args = _inputs(1, 5)
    for name, bad in (
        ("dt", args["dt"][..., :3]),
        ("A", args["A"][:4]),
        ("B", args["B"][..., :8]),
        ("dt_bias", args["dt_bias"][:2]),
        ("D", args["D"][:1]),
    ):
        with pytest.raises(ValueError, match=rf"expects {name} "):
            scan(**dict(args, **{name: bad}))
    with pytest.raises(ValueError, match="chunk_size"):
        scan(**args, chunk_size=0)


# ------------------------------------------------------------------------------------- cached op


def _flat(args, rows):
    """Concatenate token ranges ``rows = [(sequence, start, end), ...]`` of per-sequence inputs
    into the cached op's flattened [1, T, ...] per-token arguments."""
    return {k: torch.cat([args[k][i, a:e] for i, a, e in rows])[None] for k in ("hidden_states", "B", "C", "dt")}


def _step(args, state, rows, slots, num_prefill, chunk=8, op=None):
    """One cached step of ``op`` (default: the torch reference) over ``rows`` (prefill sequences
    first); returns per-row outputs."""
    flat = _flat(args, rows)
    seq_lens = torch.tensor([e - a for _, a, e in rows], dtype=torch.int32)
    input_pos = torch.tensor([a for _, a, _ in rows], dtype=torch.int32)
    slot_idx = torch.tensor(slots, dtype=torch.int32)
    y = (op or cached_scan)(
        flat["hidden_states"],
        args["A"],
        flat["B"],
        flat["C"],
        args["D"],
        flat["dt"],
        args["dt_bias"],
        seq_lens,
        input_pos,
        slot_idx,
        num_prefill,
        state,
        chunk_size=chunk,
    )
    assert y.shape == flat["hidden_states"].shape
    return list(torch.split(y[0], seq_lens.tolist()))


def check_schedule(op=None, d=12, n=16) -> None:
    """Three sequences (40, 24 and 9 tokens) in their own slots of a garbage-filled (NaN) state:
    a first prefill chunk each; then sequence 0's second chunk (chunked prefill from its slot)
    next to decode rows of the others; then mixed decode steps until all are done. Every token's
    output equals the uncached scan of the whole sequence, every slot ends in the recurrence's
    final state, and the slots no sequence owns are left alone."""
    lens = [40, 24, 9]
    args = _inputs(3, 40, d=d, n=n, seed=5)
    ref = scan(**args, chunk_size=16)  # sequences 1, 2 use their first 24 / 9 tokens only
    state = torch.full((6, d, n), float("nan"))  # slots 0..4 + scratch slot 5: all garbage
    slots = [3, 0, 4]
    pieces: dict = {i: [] for i in range(3)}

    def run(rows, num_prefill):
        outs = _step(args, state, rows, [slots[i] for i, _, _ in rows], num_prefill, op=op)
        for (i, _, _), y in zip(rows, outs):
            pieces[i].append(y)

    run([(0, 0, 16), (1, 0, 20), (2, 0, 5)], 3)  # prefill: first chunks
    run([(0, 16, 37), (1, 20, 21), (2, 5, 6)], 1)  # chunked prefill + two decode rows
    pos = {0: 37, 1: 21, 2: 6}
    while any(pos[i] < lens[i] for i in range(3)):
        live = [i for i in range(3) if pos[i] < lens[i]]
        run([(i, pos[i], pos[i] + 1) for i in live], 0)
        for i in live:
            pos[i] += 1
    for i, length in enumerate(lens):
        out = torch.cat(pieces[i])
        one = {k: v[i : i + 1, :length] if k in ("hidden_states", "B", "C", "dt") else v for k, v in args.items()}
        truth, final = _recurrence(one)
        assert _rel_err(out, ref[i, :length]) <= REL and _rel_err(out, truth[0]) <= REL, i
        assert _rel_err(state[slots[i]], final[0]) <= REL, i
    assert torch.isnan(state[[1, 2, 5]]).all()  # slots no sequence owns are untouched


def test_cached_matches_uncached_over_chunked_prefill_and_mixed_decode():
    check_schedule()


def test_new_sequence_in_a_reused_slot_starts_from_zero():
    """A slot holding another sequence's (finite) state: input_pos 0 ignores it, for a prefill
    and for a one-token decode row alike; input_pos > 0 reads it."""
    args = _inputs(2, 10, seed=6)
    state = torch.randn(3, 12, 16)
    fresh = scan(**args, chunk_size=8)
    y_prefill, y_decode = _step(args, state, [(0, 0, 10), (1, 0, 1)], [1, 0], num_prefill=1)
    assert _rel_err(y_prefill, fresh[0]) <= REL and _rel_err(y_decode, fresh[1, :1]) <= REL
    held = state.clone()
    (y_continued,) = _step(args, state, [(1, 1, 2)], [0], num_prefill=0)
    one = {k: v[1:, 1:2] if k in ("hidden_states", "B", "C", "dt") else v for k, v in args.items()}
    want, _ = _recurrence(one, initial_state=held[:1])
    assert _rel_err(y_continued, want[0]) <= REL


def test_cached_op_refuses_inconsistent_metadata():
    args = _inputs(1, 4)
    state = torch.zeros(2, 12, 16)
    weights = (args["hidden_states"], args["A"], args["B"], args["C"], args["D"], args["dt"], args["dt_bias"])

    def meta(*rows):
        return (torch.tensor(r, dtype=torch.int32) for r in rows)

    with pytest.raises(ValueError, match="seq_lens sum"):
        cached_scan(*weights, *meta([3], [0], [0]), 1, state)
    with pytest.raises(ValueError, match="decode steps"):
        cached_scan(*weights, *meta([2, 2], [0, 0], [0, 1]), 1, state)
    with pytest.raises(ValueError, match="input_pos"):
        cached_scan(*weights, *meta([4], [0, 0], [0]), 1, state)
    with pytest.raises(ValueError, match="ssm_state must be"):
        cached_scan(*weights, *meta([4], [0], [0]), 1, state[..., :8])


def test_stateful_entry_matches_the_cached_schema():
    """The declarative entry the cache stage reads: the cached op takes the uncached op's
    positional args, then the metadata, then the fp32 state [d, state], and the same keyword
    options; the insert key is the one the Mamba-2 scan shares."""
    entry = stateful_op_for(scan.default)
    assert entry is not None and entry.insert_key == "insert_cached_ssm_attention"
    src = scan.default._schema
    positional = [a.name for a in src.arguments if not a.kwarg_only]
    options = [(a.name, str(a.type), a.default_value) for a in src.arguments if a.kwarg_only]
    for backend in ("torch", "triton"):
        dst = entry.cached_op(backend)._schema
        assert [a.name for a in dst.arguments if not a.kwarg_only] == [*positional, *STATE_METADATA_ARGS, "ssm_state"]
        assert [(a.name, str(a.type), a.default_value) for a in dst.arguments if a.kwarg_only] == options
    assert set(entry.token_args) == {"hidden_states", "B", "C", "dt"}
    (spec,) = entry.states
    assert spec.name == "ssm_state" and spec.dtype == torch.float32 and spec.shape(_inputs(2, 3, d=20, n=8)) == (20, 8)


# ------------------------------------------------------------------------ Triton (decode rows)
# ``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, so the interpreter cases run in
# one child process started with it (``python tests/test_ops_selective_scan.py --interpret``); each
# entry becomes its own pytest result. Tolerance: the kernel sums the same fp32 products as the
# torch decode rows in another order (and its softplus differs from torch's by an ulp): REL; bf16
# outputs: one bf16 ulp (2^-7 relative).

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = [
    "schedule",
    "schedule_channel_blocks",
    "decode_only_matches_torch",
    "bf16_decode",
    "mamba_generate_with_triton_backend",
]


def _decode_only_against_torch(dtype=torch.float32, d=100, n=12):
    """A decode-only step (the CUDA-graph path: no host read of the metadata): outputs and every
    state row equal the torch op's; a fresh row (input_pos 0) on a NaN slot ignores the slot;
    slots no row owns are untouched. d = 100 spans several channel blocks, the last one partial."""
    args = {k: v.to(dtype) for k, v in _inputs(3, 1, d=d, n=n, seed=8).items()}
    flat = {k: args[k].reshape(1, 3, *args[k].shape[2:]) for k in ("hidden_states", "B", "C", "dt")}
    state = torch.randn(6, d, n)
    state[2] = float("nan")
    meta = (
        torch.ones(3, dtype=torch.int32),
        torch.tensor([4, 0, 7], dtype=torch.int32),
        torch.tensor([0, 2, 5], dtype=torch.int32),
    )
    ref_state, tri_state = state.clone(), state.clone()
    call = (flat["hidden_states"], args["A"], flat["B"], flat["C"], args["D"], flat["dt"], args["dt_bias"])
    ref = cached_scan(*call, *meta, 0, ref_state)
    out = torch.ops.workbench.triton_cached_selective_scan(*call, *meta, 0, tri_state)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(out, ref) <= REL
    else:
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    assert _rel_err(tri_state[[0, 2, 5]], ref_state[[0, 2, 5]]) <= REL
    assert torch.isfinite(tri_state[2]).all()
    torch.testing.assert_close(tri_state[[1, 3, 4]], state[[1, 3, 4]], rtol=0, atol=0)


def _interpreter_checks() -> dict:
    triton_op = torch.ops.workbench.triton_cached_selective_scan
    return {
        "schedule": lambda: check_schedule(triton_op),
        "schedule_channel_blocks": lambda: check_schedule(triton_op, d=80, n=32),
        "decode_only_matches_torch": _decode_only_against_torch,
        "bf16_decode": lambda: _decode_only_against_torch(torch.bfloat16),
        "mamba_generate_with_triton_backend": lambda: generate_with_triton_backend_equals_hf(
            "mamba", "insert_cached_ssm_attention", "triton_cached_selective_scan", 4, prompt_lens=(5, 21), new_tokens=6
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
        torch.ops.workbench.triton_cached_selective_scan(*args.values(), one, one, one * 0, 0, torch.zeros(2, 12, 16))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_compiles_for_hopper():
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 down to a cubin
    here (Mamba's sizes: state 16, 64-channel blocks; and a state of 64), so a session without a
    GPU still catches what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.ssm import triton_ssm

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_ssm.kernel()  # the scan kernel shared with Mamba-2, per-channel variant
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    per_channel = dict(HAS_MAX=False, PER_CHANNEL=True)
    for constexprs, dtype in ((dict(BLOCK_D=64, BLOCK_N=16, **per_channel), "fp32"),
                              (dict(BLOCK_D=16, BLOCK_N=64, **per_channel), "bf16")):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in ("slot_ptr", "pos_ptr"):
                sig[name] = "*i32"
            elif name in ("state_ptr", "a_ptr", "dt_bias_ptr", "d_ptr"):
                sig[name] = "*fp32"
            elif name.endswith("_ptr"):
                sig[name] = f"*{dtype}"
            elif name in ("dt_min", "dt_max"):
                sig[name] = "fp32"
            else:
                sig[name] = "i64"
        compiled = triton.compile(
            ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)
        )
        assert compiled.metadata.shared <= 227 * 1024


if __name__ == "__main__":
    child_main(_interpreter_checks)
