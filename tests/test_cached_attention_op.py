"""The cached attention ops against ``torch_attention`` (the uncached canonical op).

A sequence attended in pieces through the paged cache -- prefill, chunked prefill, decode, mixed
in one call with other sequences, pages scattered over the pool -- must give what attending to the
whole sequence at once gives. Triton runs in a child process (``TRITON_INTERPRET`` must be set
before triton is imported); FlashInfer needs a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from triton_child import INTERPRETER_SKIP

import workbench.ops  # noqa: F401
from workbench.ops.attention.flashinfer_cached_attention import is_available as flashinfer_available

wb = torch.ops.workbench
HAS_TRITON_OP = importlib.util.find_spec("workbench.ops.attention.triton_cached_attention") is not None
TRITON_SKIP = "triton_cached_attention not implemented yet"


def _seqs(lens, hq=4, hkv=2, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: [torch.randn(n, h, d, generator=g).to(dtype) for n in lens]  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _reference(q, k, v, i, **kw):
    """Whole sequence i through torch_attention (bsnd, causal) in fp32, on the same (possibly
    half-precision) inputs: [L, Hq, D]."""
    return wb.torch_attention(q[i][None].float(), k[i][None].float(), v[i][None].float(), is_causal=True,
                              layout="bsnd", **kw)[0]


def run_schedule(op, lens, chunks, kw, page_size=4, num_pages=64, dtype=torch.float32, seed=0, scattered=True,
                 hq=4, hkv=2, d=8, device="cpu"):
    """Feed sequences in steps; ``chunks[step][i]`` = new tokens of sequence i (0: not in this step).
    The caches live on ``device`` for the whole schedule (the op writes them in place), and each
    step's inputs are moved there.

    Returns the max abs error of every token against the whole-sequence reference.
    """
    q, k, v = _seqs(lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=seed)
    hkv, d = k[0].shape[1:]
    k_cache = torch.zeros(num_pages, page_size, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    perm = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed + 1)).int() if scattered
            else torch.arange(num_pages, dtype=torch.int32))  # sequential: decode reads strided cache views
    per_seq = -(-max(lens) // page_size)
    page_table = perm[: len(lens) * per_seq].view(len(lens), per_seq)  # scattered, non-contiguous pages
    done = [0] * len(lens)
    err = 0.0
    for step in chunks:
        # Prefill-like sequences (>1 token, or still inside their first chunk) first, then decodes.
        active = [i for i, n in enumerate(step) if n]
        prefill = [i for i in active if step[i] > 1 or done[i] == 0]
        order = prefill + [i for i in active if i not in prefill]
        sl = torch.tensor([step[i] for i in order], dtype=torch.int32)
        ip = torch.tensor([done[i] for i in order], dtype=torch.int32)
        cat = lambda xs: torch.cat([xs[i][done[i]: done[i] + step[i]] for i in order])[None]  # noqa: E731
        on = lambda t: t.to(device)  # noqa: E731
        kw_on = {n: on(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        out = op(on(cat(q)), on(cat(k)), on(cat(v)), k_cache, v_cache, on(sl), on(ip), on(page_table[order]),
                 len(prefill), 0.3, **kw_on).cpu()
        assert out.shape == (1, int(sl.sum()), q[0].shape[1], d) and out.dtype == dtype
        off = 0
        for i in order:
            ref = _reference(q, k, v, i, scale=0.3, **kw)[done[i]: done[i] + step[i]]
            err = max(err, (out[0, off: off + step[i]].float() - ref.float()).abs().max().item())
            off += step[i]
            done[i] += step[i]
    assert done == list(lens)
    return err


LENS = [7, 5, 9, 1, 12]
# step 1: mixed prefill (seq 2 chunked); step 2: seq 0 decode, seq 2 next chunk, seq 4 joins;
# then decode everything to the end (sequence 3 is a 1-token prompt).
SCHEDULE = [
    [6, 4, 4, 1, 0],
    [1, 1, 3, 0, 5],
    [0, 0, 1, 0, 4],
    [0, 0, 1, 0, 1],
    [0, 0, 0, 0, 1],
    [0, 0, 0, 0, 1],
]
VARIANTS = {
    "plain": {},
    "sliding_window": {"sliding_window": 3},
    "logit_cap": {"logit_cap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_cached_attention_matches_uncached(variant):
    assert run_schedule(wb.torch_cached_attention, LENS, SCHEDULE, VARIANTS[variant]) < 1e-5


def test_decode_on_sequential_pages_reads_cache_views():
    """Pages handed out in order (a fresh allocator): decode rows are evenly spaced runs of pages,
    read through a strided view of the cache instead of a gather -- same results."""
    from workbench.ops.attention.torch_cached_attention import _page_grid

    assert _page_grid(torch.tensor([[4, 5, 6], [7, 8, 9]])) == (4, 3)
    assert _page_grid(torch.tensor([[4, 5], [8, 9], [12, 13]])) == (4, 4)
    assert _page_grid(torch.tensor([[4, 5], [8, 9], [13, 14]])) is None  # uneven spacing
    assert _page_grid(torch.tensor([[4, 6]])) is None  # not consecutive
    assert _page_grid(torch.tensor([[4, 5], [5, 6]])) is None  # overlapping rows
    assert run_schedule(wb.torch_cached_attention, LENS, SCHEDULE, {}, scattered=False) < 1e-5
    equal = [9, 9, 9]  # 4 + 2 prefill chunks, then 3 decode steps of equal lengths (no mask)
    assert run_schedule(wb.torch_cached_attention, equal, [[4, 4, 4], [2, 2, 2]] + [[1, 1, 1]] * 3,
                        {}, scattered=False) < 1e-5


def test_torch_cached_attention_bf16_and_page_size_one():
    err = run_schedule(wb.torch_cached_attention, LENS, SCHEDULE, {}, dtype=torch.bfloat16)
    assert err < 2e-2  # bf16 inputs, fp32 softmax: the output rounding dominates
    assert run_schedule(wb.torch_cached_attention, LENS, SCHEDULE, {}, page_size=1) < 1e-5


def test_cache_writes_land_in_the_right_pages():
    q, k, v = _seqs([3])
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    pt = torch.tensor([[3, 1]], dtype=torch.int32)
    wb.torch_cached_attention(q[0][None], k[0][None], v[0][None], k_cache, v_cache,
                              torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), pt, 1, 1.0)
    assert torch.equal(k_cache[3], k[0][:2]) and torch.equal(k_cache[1, 0], k[0][2])
    assert torch.equal(v_cache[3], v[0][:2]) and k_cache[0].abs().sum() == 0 and k_cache[2].abs().sum() == 0


def test_stale_nan_in_unwritten_slots_does_not_leak():
    q, k, v = _seqs([5])
    k_cache = torch.full((4, 4, 2, 8), float("nan"))
    v_cache = torch.full((4, 4, 2, 8), float("nan"))
    pt = torch.tensor([[0, 1]], dtype=torch.int32)
    one = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    wb.torch_cached_attention(q[0][None, :4], k[0][None, :4], v[0][None, :4], k_cache, v_cache, one(4), one(0), pt, 1, 0.3)
    out = wb.torch_cached_attention(q[0][None, 4:], k[0][None, 4:], v[0][None, 4:], k_cache, v_cache, one(1), one(4), pt, 0, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], _reference(q, k, v, 0, scale=0.3)[4:])


def test_stale_nan_does_not_leak_into_a_decode_batch_of_different_lengths():
    """The batched decode path reads every sequence up to the longest one under a mask: stale
    keys or values past a shorter sequence's end must not turn its output into NaN."""
    q, k, v = _seqs([6, 3])
    k_cache = torch.full((4, 4, 2, 8), float("nan"))
    v_cache = torch.full((4, 4, 2, 8), float("nan"))
    pt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    for i, n in enumerate((5, 2)):  # prefill all but the last token of each sequence
        wb.torch_cached_attention(q[i][None, :n], k[i][None, :n], v[i][None, :n], k_cache, v_cache, i32(n),
                                  i32(0), pt[i: i + 1], 1, 0.3)
    last = [torch.stack([x[0][5], x[1][2]])[None] for x in (q, k, v)]  # [1, 2, H, D]: one token each
    out = wb.torch_cached_attention(*last, k_cache, v_cache, i32(1, 1), i32(5, 2), pt, 0, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], _reference(q, k, v, 0, scale=0.3)[5])
    torch.testing.assert_close(out[0, 1], _reference(q, k, v, 1, scale=0.3)[2])


def test_bad_metadata_is_a_clear_error():
    q, k, v = _seqs([4])
    kc = torch.zeros(4, 4, 2, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="seq_lens sum to 3"):
        wb.torch_cached_attention(q[0][None], k[0][None], v[0][None], kc, kc.clone(), i32(3), i32(0), i32(0)[None], 1, 1.0)
    with pytest.raises(ValueError, match="decode steps"):
        wb.torch_cached_attention(q[0][None], k[0][None], v[0][None], kc, kc.clone(), i32(4), i32(0), i32(0)[None], 0, 1.0)
    with pytest.raises(ValueError, match="needs 2 pages"):
        wb.torch_cached_attention(q[0][None], k[0][None], v[0][None], kc, kc.clone(), i32(4), i32(1), i32(0)[None], 1, 1.0)


@pytest.mark.parametrize("name", ["torch_cached_attention", "flashinfer_cached_attention"])
def test_fake_impl_and_schema(name):
    op = getattr(wb, name).default
    assert [a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write] == ["k_cache", "v_cache"]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 10, 4, 8), torch.empty(1, 10, 2, 8)
        out = op(q, k, k, torch.empty(8, 4, 2, 8), torch.empty(8, 4, 2, 8), torch.empty(2, dtype=torch.int32),
                 torch.empty(2, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32), 1, 0.5)
    assert out.shape == (1, 10, 4, 8)


def test_opcheck_torch_cached_attention():
    q, k, v = _seqs([6, 1], seed=3)
    kc, vc = torch.zeros(8, 4, 2, 8), torch.zeros(8, 4, 2, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = (torch.cat(q)[None], torch.cat(k)[None], torch.cat(v)[None], kc, vc, i32(6, 1), i32(0, 3),
            i32(0, 1, 2, 3).view(2, 2), 1, 0.3)
    torch.library.opcheck(wb.torch_cached_attention.default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(flashinfer_available()[0], reason="flashinfer is available here")
def test_flashinfer_says_what_is_missing():
    ok, why = flashinfer_available()
    assert not ok and ("flashinfer" in why or "CUDA" in why)
    q, k, v = _seqs([2], d=64, dtype=torch.bfloat16)
    kc = torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match="cannot run: .*Use the 'triton' or 'torch' backend"):
        wb.flashinfer_cached_attention(q[0][None], k[0][None], v[0][None], kc, kc.clone(), i32(2), i32(0), i32(0)[None], 1, 1.0)


@pytest.mark.parametrize("d, dtype, why", [(8, torch.bfloat16, "head_dim 8 is not one FlashInfer builds kernels for"),
                                           (64, torch.float32, "dtype float32")])
def test_flashinfer_refuses_shapes_it_cannot_serve_up_front(d, dtype, why):
    """Checked before availability and before FlashInfer is touched: on any machine."""
    q, k, v = _seqs([2], d=d, dtype=dtype)
    kc = torch.zeros(2, 4, 2, d, dtype=dtype)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=f"cannot serve this call: {why}.*'triton' or 'torch'"):
        wb.flashinfer_cached_attention(q[0][None], k[0][None], v[0][None], kc, kc.clone(), i32(2), i32(0), i32(0)[None], 1, 1.0)


FLASHINFER_VARIANTS = ["plain", "sliding_window", "logit_cap"]  # sinks: refused (not in this backend)


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available()[0], reason=f"flashinfer backend unavailable: {flashinfer_available()[1]}")
@pytest.mark.parametrize("variant", FLASHINFER_VARIANTS)
def test_flashinfer_cached_attention_matches_reference(variant, dtype=torch.bfloat16):
    """The real FlashInfer kernels (JIT-built on first use: tools/flashinfer_warmup.py builds these
    variants first in gpu_check), bf16, head dim 64, GQA 3, page size 16."""
    err = run_schedule(wb.flashinfer_cached_attention, LENS, SCHEDULE, VARIANTS[variant], page_size=16,
                       dtype=dtype, hq=6, hkv=2, d=64, device="cuda")
    assert err < 3e-2, err


# ------------------------------------------------------------------------------ triton (child process)


@pytest.mark.skipif(not HAS_TRITON_OP, reason=TRITON_SKIP)
@pytest.mark.skipif(bool(INTERPRETER_SKIP), reason=INTERPRETER_SKIP)
def test_triton_cached_attention_matches_uncached():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "--triton-child"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(e < 1e-4 for e in errors.values()), errors


def _triton_child() -> None:
    import workbench.ops.attention.triton_cached_attention  # noqa: F401

    errors = {name: run_schedule(wb.triton_cached_attention, LENS, SCHEDULE, kw) for name, kw in VARIANTS.items()}
    print(json.dumps(errors))


if __name__ == "__main__" and "--triton-child" in sys.argv:
    _triton_child()
