"""The decayed linear-attention ops: chunked form == token recurrence == HF MiniMax's block form;
cached == uncached over chunked prefills, mixed decode steps and reused / garbage-filled state slots;
the Triton decode rows == the torch ones (under ``TRITON_INTERPRET=1``).

Tolerance: the chunked form and the recurrence sum the same fp32 terms in another order (chunk
matmuls vs one rank-1 update per token), over sequences of <= 40 tokens with O(1) values:
differences are a few ulps of the outputs, so ``atol = rtol = 1e-5``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

import workbench.ops.linear_attention  # noqa: F401
from workbench.ops.linear_attention.linear_attention import prepare, recurrent_linear_attention
from workbench.ops.state import stateful_op_for

ops = torch.ops.workbench
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, s, hk, h, dk, dv, seed=0, dtype=torch.float32):
    """q/k/v like a real layer's, log decays in [-1, 0] (per token and head)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v, g))


def _recurrence(q, k, v, g, scale=1.0, state=None):
    qf, kf, vf, gf = prepare(q, k, v, g, scale)
    if state is None:
        state = vf.new_zeros(vf.shape[0], vf.shape[1], kf.shape[-1], vf.shape[-1])
    out, final = recurrent_linear_attention(qf, kf, vf, gf, state)
    return out.transpose(1, 2), final


@pytest.mark.parametrize("chunk_size,s", [(4, 17), (8, 8), (64, 23), (1, 5), (16, 40)])
def test_chunked_op_equals_recurrence(chunk_size, s):
    """Grouped value heads (4 value heads over 2 query/key heads), a scale, and sequences that end
    mid-chunk: the op equals the plain per-token recurrence."""
    q, k, v, g = _inputs(2, s, 2, 4, 8, 6, seed=s)
    out = ops.torch_linear_attention(q, k, v, g, scale=0.5, chunk_size=chunk_size)
    torch.testing.assert_close(out, _recurrence(q, k, v, g, 0.5)[0], **TOL)


def test_op_equals_hf_minimax_lightning_blocks():
    """HF's ``MiniMaxLightningAttention`` core (its block loop with the module's own decay buffers:
    a constant decay exp(-slope) per head, block size 16) on q/k/v of 40 tokens: the op with
    ``g = -slope_rate`` expanded over tokens gives the same outputs."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = MiniMaxConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=4,
        block_size=16,
        layer_types=["linear_attention"] * 4,
    )
    layer = MiniMaxLightningAttention(config, layer_idx=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in (layer.qkv_proj, layer.output_gate, layer.out_proj):
            lin.weight.normal_(0, 0.2, generator=gen)
        x = torch.randn(2, 40, 64, generator=gen)
        ref = layer(x, None, None)[0]
        # the same layer around the op: HF's projections, norm and gate, the recurrence replaced
        qkv = layer.act_fn(layer.qkv_proj(x)).unflatten(-1, (4, 48))
        q, k, v = qkv.split(16, dim=-1)
        g = -layer.slope_rate.reshape(1, 1, 4).expand(2, 40, 4)
        o = ops.torch_linear_attention(q, k, v, g).flatten(-2)
        got = layer.out_proj(torch.sigmoid(layer.output_gate(x)) * layer.norm(o))
    torch.testing.assert_close(got, ref, **TOL)


def test_chunked_final_state_from_a_given_state_equals_recurrence():
    from workbench.ops.linear_attention.linear_attention import chunked_linear_attention

    q, k, v, g = _inputs(1, 19, 1, 2, 8, 8, seed=4)
    state = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    qf, kf, vf, gf = prepare(q, k, v, g, 1.0)
    out, final = chunked_linear_attention(qf, kf, vf, gf, state, 4)
    ref_out, ref_final = recurrent_linear_attention(qf, kf, vf, gf, state)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


# ------------------------------------------------------------------------------ cached


def _cached(q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, backend="torch", **opts):
    meta = (
        *(torch.tensor(x, dtype=torch.int32, device=q.device) for x in (seq_lens, input_pos, slot_idx)),
        num_prefill,
        state,
    )
    return getattr(ops, f"{backend}_cached_linear_attention")(q, k, v, g, *meta, **opts)


def _run_schedule(seqs, steps, slots, state, backend="torch", **opts):
    """Feed ``seqs`` (name -> (q, k, v, g) of one whole sequence, [1, L, ...]) through the cached op,
    one call per entry of ``steps``: ``(num_prefill, [(name, n_tokens), ...])``, prefill sequences
    first. Returns name -> output [L, h, dv]."""
    done = {name: 0 for name in seqs}
    outs = {name: [] for name in seqs}
    for num_prefill, step in steps:
        parts = [[t[:, done[name] : done[name] + n] for t in seqs[name]] for name, n in step]
        flat = [torch.cat([p[j] for p in parts], dim=1) for j in range(4)]
        out = _cached(
            *flat,
            [n for _, n in step],
            [done[name] for name, _ in step],
            [slots[name] for name, _ in step],
            num_prefill,
            state,
            backend=backend,
            **opts,
        )
        start = 0
        for name, n in step:
            outs[name].append(out[0, start : start + n])
            done[name] += n
            start += n
    for name, (q, *_rest) in seqs.items():
        assert done[name] == q.shape[1], f"the schedule leaves {name} unfinished"
    return {name: torch.cat(o) for name, o in outs.items()}


def test_cached_steps_equal_uncached_sequences(backend="torch"):
    """Chunked prefills (a first chunk, then one starting mid-sequence), one-token decodes of
    several sequences in one step, a one-token prompt handled as a decode row, and slots that hold
    garbage (NaN) or a finished sequence's state: every output equals the uncached op on the whole
    sequence, and the slot holds the recurrence's state after its sequence's last token."""
    lengths = {"A": 18, "B": 7, "C": 11, "D": 1, "E": 5}
    seqs = {name: _inputs(1, n, 2, 4, 8, 6, seed=10 + i) for i, (name, n) in enumerate(lengths.items())}
    state = torch.full((6, 4, 8, 6), float("nan"))  # 5 sequence slots + the scratch slot, never written
    slots = {"A": 3, "B": 0, "C": 1, "D": 4, "E": 0}  # E starts after B has finished and reuses its slot
    steps = [
        (2, [("A", 7), ("B", 6)]),  # A's first chunk, B's whole prompt
        (2, [("A", 6), ("C", 5), ("B", 1)]),  # A's second chunk (from input_pos 7), C's first chunk, B decodes
        (1, [("C", 4), ("A", 1), ("D", 1)]),  # C's second chunk; D's one-token prompt as a decode row
        (0, [("A", 1), ("C", 1)]),  # decode only
        (1, [("E", 4), ("A", 1)]),  # E's prompt in B's old slot (which holds B's final state)
        (0, [("A", 1), ("C", 1), ("E", 1)]),
        (0, [("A", 1)]),
    ]
    opts = dict(scale=0.25, chunk_size=4)
    got = _run_schedule(seqs, steps, slots, state, backend=backend, **opts)
    for name, (q, k, v, g) in seqs.items():
        torch.testing.assert_close(
            got[name], ops.torch_linear_attention(q, k, v, g, **opts)[0], **TOL, msg=f"sequence {name}"
        )
    for name in ("A", "C", "E"):
        q, k, v, g = seqs[name]
        torch.testing.assert_close(
            state[slots[name]], _recurrence(q, k, v, g, 0.25)[1][0], **TOL, msg=f"state of {name}"
        )


def test_cached_fresh_prefill_is_bitwise_the_uncached_op():
    """A prefill from position 0 runs exactly the uncached computation, whatever its slot held."""
    q, k, v, g = _inputs(1, 11, 2, 2, 8, 8, seed=5)
    state = torch.full((3, 2, 8, 8), float("inf"))
    out = _cached(q, k, v, g, [11], [0], [1], 1, state)
    assert torch.equal(out, ops.torch_linear_attention(q, k, v, g))
    assert torch.isfinite(state[1]).all() and torch.isinf(state[0]).all() and torch.isinf(state[2]).all()


def test_cached_low_precision_inputs_keep_an_fp32_state():
    q, k, v, g = _inputs(1, 9, 2, 2, 8, 8, seed=6, dtype=torch.bfloat16)
    state = torch.zeros(2, 2, 8, 8)
    first = _cached(q[:, :5], k[:, :5], v[:, :5], g[:, :5], [5], [0], [0], 1, state)
    rest = _cached(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], [4], [5], [0], 1, state)
    assert first.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(
        torch.cat([first, rest], 1), ops.torch_linear_attention(q, k, v, g), atol=1e-2, rtol=1e-2
    )


# ------------------------------------------------------------------------------ fakes, errors, registry


def test_fakes_give_the_output_shape_without_computing():
    with FakeTensorMode():
        q, k, v, g = _inputs(3, 7, 2, 4, 8, 6)
        assert ops.torch_linear_attention(q, k, v, g).shape == (3, 7, 4, 6)
        meta = (
            torch.tensor([4, 2, 1], dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32),
            2,
            torch.empty(4, 4, 8, 6),
        )
        flat = [t[:1] for t in (q, k, v, g)]
        assert ops.torch_cached_linear_attention(*flat, *meta).shape == (1, 7, 4, 6)
        assert ops.triton_cached_linear_attention(*flat, *meta).shape == (1, 7, 4, 6)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(v=torch.randn(1, 5, 3, 6)), "3 value heads is not a multiple of 2"),
        (dict(g=torch.rand(4)), r"g \[b, s, value_heads\]"),
        (dict(k=torch.randn(1, 5, 2, 4)), "q and k of one shape"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
    ],
)
def test_bad_arguments_are_named(bad, match):
    q, k, v, g = _inputs(1, 5, 2, 4, 8, 6)
    args = dict(q=q, k=k, v=v, g=g)
    chunk = bad.pop("chunk_size", 64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ops.torch_linear_attention(*args.values(), chunk_size=chunk)


def test_bad_cached_calls_are_named():
    q, k, v, g = _inputs(1, 5, 2, 4, 8, 6)
    state = torch.zeros(2, 4, 8, 6)
    with pytest.raises(ValueError, match=r"state must be \[num_slots, value_heads, dk, dv\]"):
        _cached(q, k, v, g, [5], [0], [0], 1, torch.zeros(2, 4, 6, 8))
    with pytest.raises(ValueError, match="seq_lens sum to 4 tokens but q has 5"):
        _cached(q, k, v, g, [4], [0], [0], 1, state)
    with pytest.raises(ValueError, match="must be decode steps"):
        _cached(q, k, v, g, [3, 2], [0, 0], [0, 1], 1, state)
    with pytest.raises(ValueError, match="metadata sizes disagree"):
        _cached(q, k, v, g, [5], [0, 0], [0], 1, state)
    with pytest.raises(ValueError, match="flattened tokens"):
        _cached(*(torch.cat([t, t]) for t in (q, k, v, g)), [5, 5], [0, 0], [0, 1], 2, state)


def test_stateful_entry_agrees_with_the_schema():
    entry = stateful_op_for(ops.torch_linear_attention.default)
    assert entry.insert_key == "insert_cached_linear_attention"
    assert [s.name for s in entry.states] == ["linear_attention_state"] and entry.states[0].dtype == torch.float32
    q, _, v, _ = _inputs(2, 3, 2, 4, 8, 6)
    assert entry.states[0].shape({"q": q, "v": v}) == (4, 8, 6)
    source = [a.name for a in entry.source_op._schema.arguments if not a.kwarg_only]
    assert set(entry.token_args) <= set(source)
    for backend in ("torch", "triton"):
        schema = entry.cached_op(backend)._schema
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        assert positional == [*source, "seq_lens", "input_pos", "slot_idx", "num_prefill", "linear_attention_state"]
        assert schema.arguments[positional.index("linear_attention_state")].alias_info.is_write
        assert [a.name for a in schema.arguments if a.kwarg_only] == ["scale", "chunk_size"]


# ------------------------------------------------------------------------------ Triton (decode rows)
# The interpreter cases run in one child started with TRITON_INTERPRET=1 (``triton_child.py``).
# Tolerance: the kernel sums the same fp32 products as the torch decode rows in another order: 1e-5;
# bf16 outputs: their own rounding, 1e-2.

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = ["schedule", "decode_only", "decode_only_odd_dims", "bf16_decode", "minimax_generate_with_triton"]


def _decode_only_against_torch(dk=8, dv=6, dtype=torch.float32, tol=1e-5):
    """A decode-only step (no host read of the metadata): outputs and every state row equal the
    torch op's; a fresh row (input_pos 0) on a NaN slot ignores the slot."""
    q, k, v, g = _inputs(1, 4, 2, 4, dk, dv, seed=8, dtype=dtype)
    state = torch.randn(6, 4, dk, dv, generator=torch.Generator().manual_seed(9))
    state[2] = float("nan")
    args = ([1, 1, 1, 1], [4, 0, 7, 2], [0, 2, 5, 3], 0)
    ref_state, tri_state = state.clone(), state.clone()
    ref = _cached(q, k, v, g, *args, ref_state, scale=0.5)
    out = _cached(q, k, v, g, *args, tri_state, backend="triton", scale=0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(tri_state, ref_state, **TOL, equal_nan=True)
    assert torch.isfinite(tri_state[2]).all()


def _interpreter_checks() -> dict:
    return {
        "schedule": lambda: test_cached_steps_equal_uncached_sequences(backend="triton"),
        "decode_only": _decode_only_against_torch,
        # dk 12 (not a power of two: masked key rows), dv 80 (two value blocks of 64, the second masked)
        "decode_only_odd_dims": lambda: _decode_only_against_torch(dk=12, dv=80),
        "bf16_decode": lambda: _decode_only_against_torch(dtype=torch.bfloat16, tol=1e-2),
        "minimax_generate_with_triton": lambda: generate_with_triton_backend_equals_hf(
            "minimax", "insert_cached_linear_attention", "triton_cached_linear_attention", 2, new_tokens=6
        ),
    }


interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_triton_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g = _inputs(1, 1, 1, 1, 4, 4)
    with pytest.raises(RuntimeError, match=r"insert_cached_linear_attention\.backend=torch"):
        _cached(q, k, v, g, [1], [0], [0], 0, torch.zeros(2, 1, 4, 4), backend="triton")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernel_compiles_for_hopper(dtype):
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 here, at
    MiniMax-Text-01 sizes (dk = dv = 128) and a small grouped case."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.delta_rule import triton_delta_rule  # the fast-weight kernel, DELTA=False

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_delta_rule.kernel()
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    linear = dict(GATED=True, DELTA=False, L2NORM=False, EPS=1e-6)
    for constexprs in (dict(REP=1, DK_POW2=128, BLOCK_V=64, **linear), dict(REP=2, DK_POW2=16, BLOCK_V=16, **linear)):
        sig = {
            name: (
                "constexpr"
                if name in constexprs
                else "*i32"
                if name in ("slot_ptr", "pos_ptr")
                else "*fp32"
                if name in ("state_ptr", "g_ptr")
                else f"*{dtype}"
                if name.endswith("_ptr")
                else "fp32"
                if name == "scale"
                else "i64"
            )
            for name in kernel.arg_names
        }
        compiled = triton.compile(
            ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)
        )
        assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_compiled_on_gpu_equals_torch():
    q, k, v, g = (t.cuda() for t in _inputs(1, 5, 2, 4, 128, 128, seed=2))
    state = torch.randn(7, 4, 128, 128, device="cuda")
    state[3] = float("nan")
    args = ([1] * 5, [4, 0, 7, 2, 1], [0, 3, 5, 2, 6], 0)
    ref_state, tri_state = state.clone(), state.clone()
    ref = _cached(q, k, v, g, *args, ref_state)
    out = _cached(q, k, v, g, *args, tri_state, backend="triton")
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tri_state, ref_state, **TOL)


if __name__ == "__main__":
    child_main(_interpreter_checks)
