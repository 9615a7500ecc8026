"""``torch_ssm`` (the Mamba-2 SSD scan) and ``torch_cached_ssm`` (its state-slot form).

Ground truth is the plain recurrence ``state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T``,
``y_t = state_t C_t + D x_t`` run token by token (``ssd.ssm_recurrence``). Tolerance: both sides
are fp32 sums of at most a few hundred terms of magnitude <= ~50 (each step's decay <= 1), so
round-off stays below ~1e-5 of the output's largest value; checks use that relative bound
(observed: ~1e-7). Sizes are tiny (4-8 heads of 8, state 16) and chunk sizes small so that every
sequence spans several chunks.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import workbench.ops.ssm  # noqa: F401
from workbench.ops.ssm.ssd import discretize_dt, heads_from_groups, ssd_chunked, ssm_recurrence
from workbench.ops.state import STATE_METADATA_ARGS, stateful_op_for
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

ssm = torch.ops.workbench.torch_ssm
cached_ssm = torch.ops.workbench.torch_cached_ssm
REL = 1e-5


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(b, s, h=4, d=8, g=2, n=16, seed=0):
    """Scan arguments with a mix of short and long memories: A in [-4, -0.25], steps around
    softplus(-3 .. 0) so some heads decay within a few tokens and some carry state for hundreds."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(b, s, h, d, generator=gen),
        A=-torch.exp(torch.empty(h).uniform_(math.log(0.25), math.log(4.0), generator=gen)),
        B=torch.randn(b, s, g, n, generator=gen),
        C=torch.randn(b, s, g, n, generator=gen),
        D=torch.randn(h, generator=gen),
        dt=torch.randn(b, s, h, generator=gen),
        dt_bias=torch.empty(h).uniform_(-3.0, 0.0, generator=gen),
    )


def _recurrence(args, time_step_min=0.0, time_step_max=None, initial_state=None):
    """(y [b, s, h, d], final state) by the token-by-token definition, D skip included."""
    x, h = args["hidden_states"].float(), args["hidden_states"].shape[2]
    step = discretize_dt(args["dt"], args["dt_bias"], time_step_min, time_step_max)
    y, state = ssm_recurrence(x, step, args["A"].float(), heads_from_groups(args["B"], h),
                              heads_from_groups(args["C"], h), initial_state)
    return y + args["D"].float()[:, None] * x, state


@pytest.mark.parametrize("s, chunk", [(1, 8), (7, 8), (8, 8), (45, 8), (45, 16), (64, 256)])
def test_ssm_equals_recurrence(s, chunk):
    args = _inputs(2, s)
    ref, _ = _recurrence(args)
    out = ssm(**args, chunk_size=chunk)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel_err(out, ref) <= REL


def test_chunked_scan_carries_initial_and_final_state():
    """The chunked core from a non-zero state (what a chunked prefill needs) ends in the
    recurrence's state, also when the last chunk is padded."""
    args = _inputs(2, 29, seed=3)
    h, n = 4, 16
    init = torch.randn(2, h, 8, n, generator=torch.Generator().manual_seed(9))
    step = discretize_dt(args["dt"], args["dt_bias"], 0.0, None)
    Bh, Ch = heads_from_groups(args["B"], h), heads_from_groups(args["C"], h)
    y, final = ssd_chunked(args["hidden_states"], step, args["A"], Bh, Ch, 8, initial_state=init)
    y_ref, final_ref = ssm_recurrence(args["hidden_states"], step, args["A"], Bh, Ch, initial_state=init)
    assert _rel_err(y, y_ref) <= REL and _rel_err(final, final_ref) <= REL


def test_time_step_limits_clamp_like_hf():
    """dt = clamp(softplus(dt + dt_bias), min, max): both limits change the result, and the op
    follows the recurrence with the same clamp."""
    args = _inputs(1, 20, seed=1)
    free = ssm(**args, chunk_size=8)
    for lo, hi in ((0.3, None), (0.0, 0.1), (0.05, 0.2)):
        ref, _ = _recurrence(args, lo, hi)
        out = ssm(**args, time_step_min=lo, time_step_max=hi, chunk_size=8)
        assert _rel_err(out, ref) <= REL
        assert _rel_err(out, free) > 1e-3  # the clamp bit


def test_groups_are_shared_by_consecutive_heads():
    """With g groups, head i reads group i // (h / g): a model whose groups are all equal is one
    whose single group serves every head."""
    args = _inputs(1, 12, h=8, g=4, seed=2)
    one = dict(args, B=args["B"][:, :, :1], C=args["C"][:, :, :1])
    same = dict(args, B=one["B"].expand(-1, -1, 4, -1), C=one["C"].expand(-1, -1, 4, -1))
    torch.testing.assert_close(ssm(**same, chunk_size=8), ssm(**one, chunk_size=8), rtol=0, atol=0)
    ref, _ = _recurrence(args)
    assert _rel_err(ssm(**args, chunk_size=4), ref) <= REL


def test_bf16_inputs_give_bf16_outputs_rounded_from_fp32():
    """The scan runs in fp32 whatever the input dtype: a bf16 call equals the fp32 call on the
    same (bf16-representable) values, rounded once to bf16 (relative step 2^-8)."""
    args = {k: v.bfloat16() for k, v in _inputs(2, 21, seed=4).items()}
    out = ssm(**args, chunk_size=8)
    ref = ssm(**{k: v.float() for k, v in args.items()}, chunk_size=8)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()


def test_bad_shapes_are_refused_with_the_argument_named():
    args = _inputs(1, 5)
    with pytest.raises(ValueError, match="dt"):
        ssm(**dict(args, dt=args["dt"][..., :3]))
    with pytest.raises(ValueError, match="groups"):
        ssm(**dict(args, B=args["B"][:, :, :1].expand(-1, -1, 3, -1), C=args["C"][:, :, :1].expand(-1, -1, 3, -1)))
    with pytest.raises(ValueError, match="dt_bias"):
        ssm(**dict(args, dt_bias=args["dt_bias"][:2]))


# ------------------------------------------------------------------------------------- cached op


def _flat(args, rows):
    """Concatenate token ranges ``rows = [(sequence, start, end), ...]`` of per-sequence inputs
    into the cached op's flattened [1, T, ...] per-token arguments."""
    out = {}
    for key in ("hidden_states", "B", "C", "dt"):
        out[key] = torch.cat([args[key][i, a:e] for i, a, e in rows])[None]
    return out


def _step(args, state, rows, slots, num_prefill, chunk=8, op=None, **options):
    """Run one cached step of ``op`` (default: the torch reference) over ``rows`` (prefill
    sequences first); returns per-row outputs."""
    flat = _flat(args, rows)
    seq_lens = torch.tensor([e - a for _, a, e in rows], dtype=torch.int32)
    input_pos = torch.tensor([a for _, a, _ in rows], dtype=torch.int32)
    slot_idx = torch.tensor(slots, dtype=torch.int32)
    y = (op or cached_ssm)(flat["hidden_states"], args["A"], flat["B"], flat["C"], args["D"], flat["dt"],
                           args["dt_bias"], seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size=chunk,
                           **options)
    assert y.shape == flat["hidden_states"].shape
    return list(torch.split(y[0], seq_lens.tolist()))


def check_schedule(op=None, h=4, d=8, g=2, n=16) -> None:
    """Three sequences (40, 24 and 9 tokens) in their own slots of a garbage-filled (NaN) state:
    a first prefill chunk each; then sequence 0's second chunk (chunked prefill from its slot)
    next to decode rows of the others; then mixed decode steps until all are done. Every token's
    output equals the uncached scan of the whole sequence, every slot ends in the recurrence's
    final state, and the scratch / unused slots are left alone."""
    lens = [40, 24, 9]
    args = _inputs(3, 40, h=h, d=d, g=g, n=n, seed=5)
    options = dict(time_step_min=0.01, time_step_max=3.0)
    ref = ssm(**args, chunk_size=16, **options)  # sequences 1, 2 use their first 24 / 9 tokens only
    state = torch.full((6, h, d, n), float("nan"))  # slots 0..4 + scratch slot 5: all garbage
    slots = [3, 0, 4]
    pieces = {i: [] for i in range(3)}

    def run(rows, num_prefill):
        outs = _step(args, state, rows, [slots[i] for i, _, _ in rows], num_prefill, op=op, **options)
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
        truth, final = _recurrence({k: v[i:i + 1, :length] if v.dim() > 1 else v for k, v in args.items()},
                                   **options)
        assert _rel_err(out, ref[i, :length]) <= REL and _rel_err(out, truth[0]) <= REL, i
        assert _rel_err(state[slots[i]], final[0]) <= REL, i
    assert torch.isnan(state[[1, 2, 5]]).all()  # slots no sequence owns are untouched


def test_cached_matches_uncached_over_chunked_prefill_and_mixed_decode():
    check_schedule()


def test_new_sequence_in_a_reused_slot_starts_from_zero():
    """A slot holding another sequence's (finite) state: input_pos 0 ignores it, for a prefill
    and for a one-token decode row alike; input_pos > 0 reads it."""
    args = _inputs(2, 10, seed=6)
    state = torch.randn(3, 4, 8, 16)
    fresh = ssm(**args, chunk_size=8)
    y_prefill, y_decode = _step(args, state, [(0, 0, 10), (1, 0, 1)], [1, 0], num_prefill=1)
    assert _rel_err(y_prefill, fresh[0]) <= REL and _rel_err(y_decode, fresh[1, :1]) <= REL
    held = state.clone()
    y_continued, = _step(args, state, [(1, 1, 2)], [0], num_prefill=0)
    step = discretize_dt(args["dt"][1:, 1:2], args["dt_bias"], 0.0, None)
    want, _ = ssm_recurrence(args["hidden_states"][1:, 1:2], step, args["A"], heads_from_groups(args["B"][1:, 1:2], 4),
                             heads_from_groups(args["C"][1:, 1:2], 4), initial_state=held[:1])
    want = want + args["D"][:, None] * args["hidden_states"][1:, 1:2]
    assert _rel_err(y_continued, want[0]) <= REL


def test_cached_op_refuses_inconsistent_metadata():
    args = _inputs(1, 4)
    state = torch.zeros(2, 4, 8, 16)
    with pytest.raises(ValueError, match="seq_lens sum"):
        cached_ssm(args["hidden_states"], args["A"], args["B"], args["C"], args["D"], args["dt"], args["dt_bias"],
                   torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                   torch.tensor([0], dtype=torch.int32), 1, state)
    with pytest.raises(ValueError, match="decode steps"):
        cached_ssm(args["hidden_states"], args["A"], args["B"], args["C"], args["D"], args["dt"], args["dt_bias"],
                   torch.tensor([2, 2], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
                   torch.tensor([0, 1], dtype=torch.int32), 1, state)
    with pytest.raises(ValueError, match="ssm_state must be"):
        cached_ssm(args["hidden_states"], args["A"], args["B"], args["C"], args["D"], args["dt"], args["dt_bias"],
                   torch.tensor([4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                   torch.tensor([0], dtype=torch.int32), 1, state[..., :8])


def test_stateful_entry_matches_the_cached_schema():
    """The declarative entry the cache stage reads: the cached op takes the uncached op's
    positional args, then the metadata, then the fp32 state [heads, head_dim, state], and the
    same keyword options."""
    entry = stateful_op_for(ssm.default)
    assert entry is not None and entry.insert_key == "insert_cached_ssm_attention"
    src, dst = ssm.default._schema, entry.cached_op("torch")._schema
    positional = [a.name for a in src.arguments if not a.kwarg_only]
    options = [(a.name, str(a.type), a.default_value) for a in src.arguments if a.kwarg_only]
    assert [a.name for a in dst.arguments if not a.kwarg_only] == positional + list(STATE_METADATA_ARGS) + ["ssm_state"]
    assert [(a.name, str(a.type), a.default_value) for a in dst.arguments if a.kwarg_only] == options
    assert set(entry.token_args) == {"hidden_states", "B", "C", "dt"}
    fake = _inputs(2, 3, h=6, d=8, g=3, n=16)
    (spec,) = entry.states
    assert spec.name == "ssm_state" and spec.dtype == torch.float32 and spec.shape(fake) == (6, 8, 16)


# ------------------------------------------------------------------------ Triton (decode rows)
# ``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, so the interpreter cases run in
# one child process started with it (``python tests/test_ops_ssm.py --interpret``), which prints
# {case: "ok" | traceback}; each entry becomes its own pytest result (as test_triton_norm_rope).
# Tolerance: the kernel sums the same fp32 products as the torch decode rows in another order (and
# its softplus differs from torch's by an ulp): REL as above; bf16 outputs: one bf16 ulp (2^-7 relative).

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = ["schedule", "schedule_two_head_dim_blocks", "decode_only_matches_torch", "bf16_decode",
                "mamba2_generate_with_triton_backend"]


def _decode_only_against_torch(dtype=torch.float32, h=6, d=20, g=3, n=12):
    """A decode-only step (the CUDA-graph path: no host read of the metadata) with both step
    limits: outputs and every state row equal the torch op's; a fresh row (input_pos 0) on a NaN
    slot ignores the slot; slots no row owns are untouched."""
    args = {k: v.to(dtype) for k, v in _inputs(3, 1, h=h, d=d, g=g, n=n, seed=8).items()}
    flat = {k: args[k].reshape(1, 3, *args[k].shape[2:]) for k in ("hidden_states", "B", "C", "dt")}
    state = torch.randn(6, h, d, n)
    state[2] = float("nan")
    meta = (torch.ones(3, dtype=torch.int32), torch.tensor([4, 0, 7], dtype=torch.int32),
            torch.tensor([0, 2, 5], dtype=torch.int32))
    ref_state, tri_state = state.clone(), state.clone()
    call = (flat["hidden_states"], args["A"], flat["B"], flat["C"], args["D"], flat["dt"], args["dt_bias"])
    options = dict(time_step_min=0.05, time_step_max=0.5)
    ref = cached_ssm(*call, *meta, 0, ref_state, **options)
    out = torch.ops.workbench.triton_cached_ssm(*call, *meta, 0, tri_state, **options)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(out, ref) <= REL
    else:
        # both round the same fp32 value (to ~1e-7) once: at most one bf16 ulp apart (<= 2^-7 relative)
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    assert _rel_err(tri_state[[0, 2, 5]], ref_state[[0, 2, 5]]) <= REL
    assert torch.isfinite(tri_state[2]).all()
    torch.testing.assert_close(tri_state[[1, 3, 4]], state[[1, 3, 4]], rtol=0, atol=0)


def _mamba2_generate_with_triton_backend():
    """tiny:mamba2 (checkpoint-like mixer weights) through the whole pipeline with the Triton
    cached scan: HF's greedy tokens."""
    from workbench.models.tiny_families.ssm import checkpoint_like_ssm_weights

    generate_with_triton_backend_equals_hf("mamba2", "insert_cached_ssm_attention", "triton_cached_ssm", 4,
                                           prompt_lens=(5, 21), new_tokens=6, prepare=checkpoint_like_ssm_weights)


def _interpreter_checks() -> dict:
    triton_op = torch.ops.workbench.triton_cached_ssm
    return {
        "schedule": lambda: check_schedule(triton_op),
        "schedule_two_head_dim_blocks": lambda: check_schedule(triton_op, h=2, d=64, g=1, n=128),
        "decode_only_matches_torch": _decode_only_against_torch,
        "bf16_decode": lambda: _decode_only_against_torch(torch.bfloat16),
        "mamba2_generate_with_triton_backend": _mamba2_generate_with_triton_backend,
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
        torch.ops.workbench.triton_cached_ssm(*args.values(), one, one, one * 0, 0, torch.zeros(2, 4, 8, 16))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_compiles_for_hopper():
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 down to a cubin
    here, at Mamba-2 sizes (state 128: 32 x 128 tiles), so a session without a GPU still catches
    what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.ssm import triton_ssm

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_ssm.kernel()
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    for constexprs, dtype in ((dict(BLOCK_D=32, BLOCK_N=128, HAS_MAX=False, PER_CHANNEL=False), "fp32"),
                              (dict(BLOCK_D=16, BLOCK_N=256, HAS_MAX=True, PER_CHANNEL=False), "bf16")):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in ("slot_ptr", "pos_ptr"):
                sig[name] = "*i32"
            elif name == "state_ptr":
                sig[name] = "*fp32"
            elif name.endswith("_ptr"):
                sig[name] = f"*{dtype}"
            elif name in ("dt_min", "dt_max"):
                sig[name] = "fp32"
            else:
                sig[name] = "i64"
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        assert compiled.metadata.shared <= 227 * 1024


if __name__ == "__main__":
    child_main(_interpreter_checks)
