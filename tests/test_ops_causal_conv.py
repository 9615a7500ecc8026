"""The causal conv ops: ``torch_causal_conv1d`` against ``F.conv1d``, and the cached op against the
uncached one.

A sequence convolved in pieces through its conv-state slot -- prefill, chunked prefill (chunks
shorter than the kernel's memory included), decode rows mixed with prefills in one call, a reused
slot full of NaN -- must give what convolving the whole sequence at once gives. Tolerance: fp32
with k <= 4 taps, O(1) inputs: the cached decode path sums the same k products in another order than
``F.conv1d``, so a few ulps (1e-6 absolute) apart; 1e-5 leaves margin without hiding a wrong tap
(which is O(1) off).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import workbench.ops.conv  # noqa: F401
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

wb = torch.ops.workbench
TOL = dict(atol=1e-5, rtol=1e-5)


def _weights(c, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c, 1, k, generator=g), (torch.randn(c, generator=g) if bias else None)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_uncached_matches_conv1d(k, bias, activation):
    c = 6
    w, b = _weights(c, k, bias)
    x = torch.randn(3, 7, c)
    ref = F.conv1d(x.transpose(1, 2), w, b, padding=k - 1, groups=c)[..., :7]
    ref = (F.silu(ref) if activation else ref).transpose(1, 2)
    out = wb.torch_causal_conv1d(x, w, b, activation=activation)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # the same conv call: bit-identical


def run_schedule(lens, chunks, k=4, c=6, activation="silu", bias=True, num_slots=6, seed=0,
                 op=wb.torch_cached_causal_conv1d, device="cpu"):
    """Feed sequences step by step; ``chunks[step][i]`` = new tokens of sequence i (0: absent).

    Sequence i owns slot ``slots[i]``; every slot starts as NaN (a previous owner's leftovers).
    Returns the max abs error of every output token against the whole-sequence uncached op.
    """
    w, b = (None if t is None else t.to(device) for t in _weights(c, k, bias, seed))
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(n, c, generator=g).to(device) for n in lens]
    ref = [wb.torch_causal_conv1d(x[None], w, b, activation=activation)[0] for x in xs]
    state = torch.full((num_slots, c, k - 1), float("nan"), device=device)
    slots = [num_slots - 2 - i for i in range(len(lens))]  # not in sequence order
    done, err = [0] * len(lens), 0.0
    for step in chunks:
        active = [i for i, n in enumerate(step) if n]
        prefill = [i for i in active if step[i] > 1 or done[i] == 0]
        order = prefill + [i for i in active if i not in prefill]
        x = torch.cat([xs[i][done[i]: done[i] + step[i]] for i in order])[None]
        meta = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (
            [step[i] for i in order], [done[i] for i in order], [slots[i] for i in order]))
        out = op(x, w, b, *meta, len(prefill), state, activation=activation)
        assert out.shape == x.shape
        off = 0
        for i in order:
            got, want = out[0, off: off + step[i]], ref[i][done[i]: done[i] + step[i]]
            gap = (got - want).abs().max().item()
            err = max(err, gap if gap == gap else float("inf"))  # a NaN (leaked garbage) must fail
            off += step[i]
            done[i] += step[i]
    assert done == list(lens)
    return err


LENS = [7, 5, 9, 1, 6]
# step 1: prefills (seq 2 chunked after 2 tokens: shorter than the kernel's 3-token memory; seq 3 a
# 1-token prompt); step 2: seq 0/1 decode, seq 2 a 1-token prefill chunk, seq 4 joins;
# then decode to the end (seq 2 another chunk in the middle).
SCHEDULE = [
    [6, 4, 2, 1, 0],
    [1, 1, 1, 0, 3],
    [0, 0, 4, 0, 1],
    [0, 0, 1, 0, 1],
    [0, 0, 1, 0, 1],
]


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("k", [2, 4])
def test_cached_schedule_matches_uncached(activation, k):
    assert run_schedule(LENS, SCHEDULE, k=k, activation=activation) < TOL["atol"]


def test_cached_without_bias_and_single_tap():
    assert run_schedule(LENS, SCHEDULE, k=4, bias=False) < TOL["atol"]
    assert run_schedule(LENS, SCHEDULE, k=1) < TOL["atol"]  # no state at all: [num_slots, c, 0]


def test_cached_decode_only_step_writes_its_slots_only():
    """A decode-only step (num_prefill == 0, the CPU hot path) reads and shifts exactly its slots."""
    c, k = 4, 3
    w, b = _weights(c, k)
    state = torch.randn(5, c, k - 1)
    before = state.clone()
    x = torch.randn(1, 2, c)
    slot = torch.tensor([3, 1], dtype=torch.int32)
    out = wb.torch_cached_causal_conv1d(x, w, b, torch.ones(2, dtype=torch.int32),
                                        torch.tensor([5, 9], dtype=torch.int32), slot, 0, state)
    window = torch.cat([before[slot.long()], x[0, :, :, None]], dim=2)  # [2, c, k]
    want = F.conv1d(window.reshape(1, 2 * c, k), w.repeat(2, 1, 1), b.repeat(2), groups=2 * c).view(2, c)
    torch.testing.assert_close(out[0], want, **TOL)
    torch.testing.assert_close(state[slot.long()], window[:, :, 1:], atol=0, rtol=0)
    untouched = [0, 2, 4]
    torch.testing.assert_close(state[untouched], before[untouched], atol=0, rtol=0)


def test_fake_shapes_and_meta():
    with FakeTensorMode():
        x, (w, b) = torch.empty(2, 5, 8), (torch.empty(8, 1, 4), torch.empty(8))
        assert wb.torch_causal_conv1d(x, w, b).shape == (2, 5, 8)
        state = torch.empty(3, 8, 3)
        lens = torch.empty(2, dtype=torch.int32)
        out = wb.torch_cached_causal_conv1d(torch.empty(1, 6, 8), w, b, lens, lens, lens, 1, state,
                                            activation="silu")
        assert out.shape == (1, 6, 8)
    meta = wb.torch_causal_conv1d(torch.empty(2, 5, 8, device="meta"), torch.empty(8, 1, 4, device="meta"), None)
    assert meta.shape == (2, 5, 8) and meta.device.type == "meta"


class _Conv(torch.nn.Module):
    def __init__(self, c=8, k=4):
        super().__init__()
        self.w, self.b = (torch.nn.Parameter(t) for t in _weights(c, k))

    def forward(self, x):
        return wb.torch_causal_conv1d(x, self.w, self.b, activation="silu")


def test_export_keeps_one_node_with_dynamic_batch_and_sequence():
    mod = _Conv()
    dims = {"x": {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=1024)}}
    ep = torch.export.export(mod, (torch.randn(2, 5, 8),), dynamic_shapes=dims)
    convs = [n for n in ep.graph.nodes if n.target == wb.torch_causal_conv1d.default]
    assert len(convs) == 1 and convs[0].kwargs.get("activation") == "silu"
    x = torch.randn(3, 11, 8)  # another batch and length
    torch.testing.assert_close(ep.module()(x), mod(x), atol=0, rtol=0)


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(1, 3, 4), torch.randn(4, 2, 3), None, None), "depthwise weight"),
    (lambda: (torch.randn(1, 3, 4), torch.randn(4, 3), None, None), "depthwise weight"),
    (lambda: (torch.randn(1, 3, 5), torch.randn(4, 1, 3), None, None), "channels last"),
    (lambda: (torch.randn(1, 3, 4), torch.randn(4, 1, 3), torch.randn(5), None), "bias"),
    (lambda: (torch.randn(1, 3, 4), torch.randn(4, 1, 3), None, "gelu"), "activation 'gelu'"),
])
def test_bad_input_is_rejected(make, match):
    x, w, b, act = make()
    with pytest.raises(ValueError, match=match):
        wb.torch_causal_conv1d(x, w, b, activation=act)


def test_cached_bad_metadata_is_rejected():
    w, b = _weights(4, 3)
    x, one = torch.randn(1, 3, 4), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="conv_state must be"):
        wb.torch_cached_causal_conv1d(x, w, b, one * 3, one * 0, one * 0, 1, torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="sum to 2 tokens"):
        wb.torch_cached_causal_conv1d(x, w, b, one * 2, one * 0, one * 0, 1, torch.zeros(2, 4, 2))
    two = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="decode steps"):
        wb.torch_cached_causal_conv1d(x, w, b, two, two * 0, two * 0, 0, torch.zeros(2, 4, 2))


# ------------------------------------------------------------------------ Triton (decode rows)
# ``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, so the interpreter cases run in
# one child process started with it (``python tests/test_ops_causal_conv.py --interpret``), which
# prints {case: "ok" | traceback}; each entry becomes its own pytest result (as test_triton_norm_rope).
# Tolerance: the kernel accumulates the same k fp32 products as the torch decode rows, in another
# order; 1e-5 as above. bf16: the kernel sums in fp32 and rounds once, so it is held to the fp32 op
# on the same bf16 inputs within one bf16 ulp (2^-7 relative); the torch op on bf16 rounds its
# intermediates too (measured: off by thousands of ulps where the taps cancel), so it is no reference.

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_CASES = ["schedule_k4_silu", "schedule_k2_none_no_bias", "schedule_k1", "schedule_300_channels",
                "decode_only_matches_torch", "bf16_decode", "lfm2_generate_with_triton_backend"]


def _triton_schedule(k, activation, bias=True, c=6):
    op = wb.triton_cached_causal_conv1d
    err = run_schedule(LENS, SCHEDULE, k=k, c=c, activation=activation, bias=bias, op=op)
    assert err < TOL["atol"], err


def _decode_only_against_torch(dtype=torch.float32, seed=0):
    """A decode-only step (the CUDA-graph path: no host read of the metadata): outputs and every
    state row equal the torch op's; a fresh row (input_pos 0) on a NaN slot ignores the slot."""
    c, k = 40, 4
    g = torch.Generator().manual_seed(seed)
    w, b = (t.to(dtype) for t in _weights(c, k, seed=seed))
    state = torch.randn(6, c, k - 1, generator=g).to(dtype)
    state[2] = float("nan")
    x = torch.randn(1, 3, c, generator=g).to(dtype)
    meta = (torch.ones(3, dtype=torch.int32), torch.tensor([4, 0, 7], dtype=torch.int32),
            torch.tensor([0, 2, 5], dtype=torch.int32))
    ref_state, tri_state = state.float(), state.clone()
    ref = wb.torch_cached_causal_conv1d(x.float(), w.float(), b.float(), *meta, 0, ref_state, activation="silu")
    out = wb.triton_cached_causal_conv1d(x, w, b, *meta, 0, tri_state, activation="silu")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2.0 ** -7)
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(tri_state.float(), ref_state, atol=0, rtol=0, equal_nan=True)  # a copy: exact
    assert torch.isfinite(tri_state[2]).all()


def _lfm2_generate_with_triton_backend():
    """tiny:lfm2 through the whole pipeline with the Triton cached conv: HF's greedy tokens."""
    generate_with_triton_backend_equals_hf("lfm2", "insert_cached_causal_conv", "triton_cached_causal_conv1d", 2)


def _interpreter_checks() -> dict:
    return {
        "schedule_k4_silu": lambda: _triton_schedule(4, "silu"),
        "schedule_k2_none_no_bias": lambda: _triton_schedule(2, None, bias=False),
        "schedule_k1": lambda: _triton_schedule(1, "silu"),
        "schedule_300_channels": lambda: _triton_schedule(4, "silu", c=300),  # two channel blocks
        "decode_only_matches_torch": _decode_only_against_torch,
        "bf16_decode": lambda: [_decode_only_against_torch(torch.bfloat16, seed) for seed in range(20)],
        "lfm2_generate_with_triton_backend": _lfm2_generate_with_triton_backend,
    }


interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_triton_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w, b = _weights(4, 3)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="insert_cached_causal_conv.backend=torch"):
        wb.triton_cached_causal_conv1d(torch.randn(1, 1, 4), w, b, one, one, one, 0, torch.zeros(2, 4, 2))


def test_stateful_entry_names_both_backends():
    from workbench.ops.state import stateful_ops

    entry = stateful_ops()["workbench::torch_causal_conv1d"]
    assert entry.insert_key == "insert_cached_causal_conv" and entry.token_args == ("x",)
    assert entry.cached_op("torch") == wb.torch_cached_causal_conv1d.default
    assert entry.cached_op("triton") == wb.triton_cached_causal_conv1d.default
    with FakeTensorMode():
        shape = entry.states[0].shape({"x": torch.empty(2, 5, 8), "weight": torch.empty(8, 1, 4), "bias": None})
    assert shape == (8, 3)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernel_compiles_for_hopper(dtype):
    """The interpreter skips the compiler's checks: compile the kernel for sm_90 down to a cubin
    here, at Mamba-2 / LFM2 sizes (k = 4, 256-channel blocks), so a session without a GPU still
    catches what would break on one."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.conv import triton_causal_conv

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    kernel = triton_causal_conv.kernel()
    if not isinstance(kernel, JITFunction):
        pytest.skip("the kernel was decorated under TRITON_INTERPRET=1 in this process")
    for constexprs in (dict(K=4, K_POW2=4, BLOCK_C=256, HAS_BIAS=True, SILU=True),
                       dict(K=3, K_POW2=4, BLOCK_C=128, HAS_BIAS=False, SILU=False)):
        sig = {name: ("constexpr" if name in constexprs else "*i32" if name in ("slot_ptr", "pos_ptr")
                      else f"*{dtype}" if name.endswith("_ptr") else "i64") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k, channels", [(4, 300), (3, 64), (1, 8)])
def test_triton_compiled_on_gpu(k, channels):
    err = run_schedule(LENS, SCHEDULE, k=k, c=channels, op=wb.triton_cached_causal_conv1d, device="cuda")
    assert err < TOL["atol"], err


if __name__ == "__main__":
    child_main(_interpreter_checks)
