"""The C++ CPU kernels (workbench/ops/cpu_kernels) against the reference ops they stand in for.

They run on the variant this process loads: the best for this CPU, or the one ``WORKBENCH_CPU_ISA``
forces (``tests/test_cpu_isa.py`` runs this file again under every other variant this CPU runs).

Tolerances: the kernels compute the same fp32 products and sums as the references, in another order
(SIMD lanes, blocked reductions); errors are a few fp32 ulps of the accumulated magnitude, so
``atol=rtol=1e-5`` on O(1)-O(10) outputs. The attention kernel's exp is a degree-6 polynomial
(relative error ~2e-7), below fp32 rounding of the softmax sum.
"""

from __future__ import annotations

import os

import pytest
import torch

import workbench.ops  # noqa: F401 - registers every op
from workbench.ops import cpu_kernels
from workbench.ops.quant import dequantize_int4, dequantize_int8, pack_int4, unpack_int4
from workbench.ops.quant.int4 import int4_linear_reference
from workbench.ops.quant.int8 import int8_linear_reference

WHY = cpu_kernels.load()
# skipped only where no variant can be built here (no compiler; an ISA with no variant); a forced
# variant that does not load is a failure, not a skip
pytestmark = pytest.mark.skipif(
    WHY is not None and not os.environ.get("WORKBENCH_CPU_ISA"), reason=f"CPU kernels unavailable: {WHY}"
)
W = torch.ops.workbench


def int4_weight(n: int, k: int, g: torch.Generator):
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // 32, generator=g) * 0.02).half()
    o = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).half()
    return q, s, o


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 70, 100])  # 100: the packed formats' dense (tile + BLAS) path
def test_linear_kernels_equal_the_references_at_every_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 200, 576
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    q, s, o = int4_weight(n, k, g)
    torch.testing.assert_close(W.cpu_int4_linear(x, q, s, o, 32, bias), int4_linear_reference(x, q, s, o, 32, bias),
                               atol=1e-5, rtol=1e-5)
    s64, o64 = s[:, ::2].contiguous(), o[:, ::2].contiguous()  # groups of 64 share a scale
    torch.testing.assert_close(W.cpu_int4_linear(x, q, s64, o64, 64), int4_linear_reference(x, q, s64, o64, 64),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="K/group"):
        W.cpu_int4_linear(x, q, s, o, 64)  # scales for groups of 32
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    torch.testing.assert_close(W.cpu_int8_linear(x, q8, s, 32), int8_linear_reference(x, q8, s, 32), atol=1e-4, rtol=1e-5)
    w = torch.randn(n, k, generator=g)
    out = W.cpu_linear(x.view(1, rows, k), w, bias)
    assert out.shape == (1, rows, n)
    torch.testing.assert_close(out, torch.nn.functional.linear(x.view(1, rows, k), w, bias), atol=1e-4, rtol=1e-5)


def test_reference_quantized_ops_run_the_exact_kernels_on_cpu():
    """torch_int4_linear / torch_int8_linear on fp32 CPU inputs with fp16 scales run the C++ kernels
    (``ops/quant/cpu_fast_path``): bit-identical to calling the kernel, close to the reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=g)
    q, s, o = int4_weight(300, 576, g)
    assert torch.equal(W.torch_int4_linear(x, q, s, o, 32), W.cpu_int4_linear(x, q, s, o, 32))
    torch.testing.assert_close(W.torch_int4_linear(x, q, s, o, 32), int4_linear_reference(x, q, s, o, 32),
                               atol=1e-5, rtol=1e-5)
    # fp32 scales are not what the kernel reads: the reference serves them, exactly
    assert torch.equal(W.torch_int4_linear(x, q, s.float(), o.float(), 32),
                       int4_linear_reference(x, q, s.float(), o.float(), 32))


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_int4_a8_kernel_quantizes_only_the_activations(rows):
    """cpu_int4_linear_a8 = the int4 weights against activations rounded to int8 per block of 32
    (scale max|x|/127): equal (up to fp32 summation order) to the reference run on those rounded
    activations, and within the rounding's bound of the exact result. More than 16 rows: exact path."""
    g = torch.Generator().manual_seed(rows)
    k = 1536
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 3, k)  # blocks of different ranges
    q, s, o = int4_weight(96, k, g)
    bias = torch.randn(96, generator=g)
    blocks = x.view(rows, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    x8 = (torch.round(blocks / d) * d).view(rows, k)  # round half to even, as every variant's conversion
    out = W.cpu_int4_linear_a8(x, q, s, o, 32, bias)
    torch.testing.assert_close(out, int4_linear_reference(x8, q, s, o, 32, bias), atol=2e-4, rtol=1e-5)
    exact = int4_linear_reference(x, q, s, o, 32, bias)
    assert not torch.equal(out, exact)  # it did quantize
    # |x - x8| <= d/2 per element; the output error is bounded by sum_k |w| d/2 (Cauchy-free bound)
    w = dequantize_int4(q, s, o, 32)
    bound = (w.abs() @ (d.expand_as(blocks).reshape(rows, k) / 2).T).T
    assert ((out - exact).abs() <= bound + 1e-4).all()
    big = torch.randn(17, k, generator=g)
    assert torch.equal(W.cpu_int4_linear_a8(big, q, s, o, 32), W.cpu_int4_linear(big, q, s, o, 32))


def test_int4_packing_and_dequantization():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 64), generator=g)
    packed = pack_int4(codes)
    assert packed.shape == (3, 32) and torch.equal(unpack_int4(packed), codes.to(torch.uint8))
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 16]) << 4)  # ggml's order: j and j+16
    s, o = torch.full((3, 2), 0.5).half(), torch.full((3, 2), -1.0).half()
    assert torch.equal(dequantize_int4(packed, s, o, 32), codes.float() * 0.5 - 1.0)
    q8 = torch.randint(-128, 128, (3, 64), dtype=torch.int8, generator=g)
    assert torch.equal(W.torch_int8_embedding(torch.tensor([[2, 0]]), q8, s, 32)[0],
                       dequantize_int8(q8, s, 32)[[2, 0]])


def test_linear_kernels_refuse_bad_layouts_with_the_reason():
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        W.cpu_int4_linear(x, torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 2).half(), torch.zeros(4, 2).half(), 32)
    with pytest.raises(RuntimeError, match="float32 activations"):
        W.cpu_int8_linear(x.double(), torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2).half(), 32)
    # fp32 linear: shapes it has no kernel for go to aten.linear
    torch.testing.assert_close(W.cpu_linear(torch.randn(2, 50), torch.randn(3, 50)).shape, torch.Size([2, 3]))


@pytest.mark.parametrize("b, hq, hkv, d, window, cap, sinks", [
    (1, 9, 3, 64, None, None, False),  # SmolLM2's decode shape
    (3, 4, 2, 32, None, None, False),
    (2, 8, 2, 64, 5, None, True),
    (2, 4, 4, 16, None, 30.0, False),
    # the vectorised head dims (64, 128): query groups of 6 and 7 heads (chunks of 6 / 3 heads in
    # registers), soft-capping, window and sinks on them
    (2, 12, 2, 128, None, 30.0, False),
    (3, 14, 2, 64, 20, None, True),
    (3, 9, 3, 64, None, None, False),  # 38 and 21 keys: blocks of 16 and tails
])
def test_cached_attention_kernel_equals_the_reference_on_decode_steps(b, hq, hkv, d, window, cap, sinks):
    g = torch.Generator().manual_seed(b * 100 + hq)
    pages, page_size = 40, 16
    kc, vc = torch.randn(pages, page_size, hkv, d, generator=g), torch.randn(pages, page_size, hkv, d, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    table = torch.randperm(pages, generator=g)[: b * 4].view(b, 4).int()  # scattered pages
    pos = torch.tensor([5, 37, 20][:b]).int()
    q, k, v = (torch.randn(1, b, h, d, generator=g) for h in (hq, hkv, hkv))
    meta = (torch.ones(b, dtype=torch.int32), pos, table, 0, 0.125, window, cap,
            torch.randn(hq, generator=g) if sinks else None)
    ref = W.torch_cached_attention(q, k, v, kc, vc, *meta)
    out = W.cpu_cached_attention(q, k, v, kc2, vc2, *meta)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the new k/v written to the same slots


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize("pos, hq, hkv, d, window, cap, sinks", [
    ([255], 9, 3, 64, None, None, False),  # SmolLM2 at 256 keys: the keys split into chunks
    ([300, 6], 4, 1, 128, None, 30.0, True),  # a short sequence next to a long one: empty chunks
    ([200], 8, 2, 64, 70, None, True),  # the window's keys split, sinks joined at the merge
    ([180, 90], 6, 2, 32, None, None, False),  # the head dim without a vectorised path
])
def test_cached_attention_kernel_splits_long_contexts_into_key_chunks(pos, hq, hkv, d, window, cap, sinks, threads):
    """Few (sequence, KV head) pairs with long contexts: each pair's keys are shared out to the
    threads in chunks whose partial softmax sums are merged; the result must equal the reference's."""
    g = torch.Generator().manual_seed(len(pos) * 1000 + hq + d)
    b, pages, page_size = len(pos), 48, 16
    kc, vc = torch.randn(pages, page_size, hkv, d, generator=g), torch.randn(pages, page_size, hkv, d, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    table = torch.randperm(pages, generator=g)[: b * 20].view(b, 20).int()
    q, k, v = (torch.randn(1, b, h, d, generator=g) for h in (hq, hkv, hkv))
    meta = (torch.ones(b, dtype=torch.int32), torch.tensor(pos).int(), table, 0, d ** -0.5, window, cap,
            torch.randn(hq, generator=g) if sinks else None)
    ref = W.torch_cached_attention(q, k, v, kc, vc, *meta)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = W.cpu_cached_attention(q, k, v, kc2, vc2, *meta)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_cached_attention_kernel_hands_prefill_and_other_dtypes_to_the_reference():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 7, 4, 32, generator=g), torch.randn(1, 7, 2, 32, generator=g), torch.randn(1, 7, 2, 32, generator=g)
    table = torch.arange(8).view(2, 4).int()
    meta = (torch.tensor([6, 1]).int(), torch.tensor([0, 3]).int(), table, 1, 0.2)
    caches = [torch.zeros(8, 16, 2, 32) for _ in range(4)]
    assert torch.equal(W.cpu_cached_attention(q, k, v, caches[0], caches[1], *meta),
                       W.torch_cached_attention(q, k, v, caches[2], caches[3], *meta))
    bf = [c.bfloat16() for c in caches]
    dmeta = (torch.ones(2, dtype=torch.int32), torch.tensor([2, 5]).int(), table, 0, 0.2)
    qd, kd, vd = (t[:, :2].bfloat16() for t in (q, k, v))
    assert torch.equal(W.cpu_cached_attention(qd, kd, vd, bf[0], bf[1], *dmeta),
                       W.torch_cached_attention(qd, kd, vd, bf[2], bf[3], *dmeta))


def test_elementwise_kernels_equal_the_references():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(W.cpu_rmsnorm(x, w, 1e-5), W.torch_rmsnorm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    q, k = torch.randn(2, 5, 9, 64, generator=g), torch.randn(2, 5, 3, 64, generator=g)
    cos, sin = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    for dim, (qq, kk) in ((2, (q, k)), (1, (q.transpose(1, 2), k.transpose(1, 2)))):
        for got, ref in zip(W.cpu_rope_with_explicit_cos_sin(qq, kk, cos, sin, dim),
                            W.torch_rope_with_explicit_cos_sin(qq, kk, cos, sin, dim)):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # q/k as slices of one fused QKV output (read through their strides, results contiguous)
    qkv = torch.randn(2, 5, 15 * 64, generator=g)
    qs, ks = qkv[..., :576].view(2, 5, 9, 64), qkv[..., 576:768].view(2, 5, 3, 64)
    for got, ref in zip(W.cpu_rope_with_explicit_cos_sin(qs, ks, cos, sin, 2),
                        W.torch_rope_with_explicit_cos_sin(qs.contiguous(), ks.contiguous(), cos, sin, 2)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert got.is_contiguous()
    h = torch.randn(3, 2 * 1536, generator=g) * 6  # silu over both signs, large and small
    torch.testing.assert_close(W.cpu_silu_and_mul(h), W.torch_silu_and_mul(h), atol=1e-5, rtol=1e-5)
    d = h.double()[:, :20]  # no kernel for fp64 or odd widths: the reference answers
    assert torch.equal(W.cpu_silu_and_mul(d), W.torch_silu_and_mul(d))


def test_the_loaded_variant_is_the_one_asked_for():
    asked = os.environ.get("WORKBENCH_CPU_ISA")
    expected = asked or cpu_kernels.isa.choose()[0].name
    assert WHY is None, WHY
    assert cpu_kernels.loaded_variant() == expected
    assert cpu_kernels.describe() == f"C++ kernels, {cpu_kernels.isa.BY_NAME[expected].title} build"


def test_kernels_refuse_other_devices():
    ok, why = cpu_kernels.is_available(torch.device("meta"))
    assert not ok and "CPU tensors" in why
