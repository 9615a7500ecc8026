"""The quantization format codecs (``workbench/ops/quant/codecs.py``): exact round trips where the
format is exact (e2m1 code table, FP4 packing, e8m0, GPTQ words, representable NVFP4/MXFP4 data),
error bounds derived from each format's precision where it is not, saturation, and clear errors
for shapes a format cannot hold."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.ops.quant import codecs as C
from workbench.ops.quant.int4 import dequantize_int4, pack_int4


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------- e2m1 / FP4
def test_e2m1_code_table_round_trips_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = C.e2m1_decode(codes)
    expected = list(C.E2M1_VALUES) + [-v for v in C.E2M1_VALUES]
    assert values.tolist() == expected
    assert torch.signbit(values[8])  # code 8 is -0.0
    assert torch.equal(C.e2m1_encode(values), codes)


def _nearest_even_reference(x: float) -> int:
    """Brute force: the nearest magnitude, ties to the even code, saturating at 6; sign in bit 3."""
    m = min(abs(x), C.E2M1_MAX)
    dists = [abs(m - v) for v in C.E2M1_VALUES]
    best = min(dists)
    candidates = [c for c, d in enumerate(dists) if d == best]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return code | (8 if math.copysign(1.0, x) < 0 else 0)


def test_e2m1_encode_rounds_to_nearest_with_ties_to_even_and_saturates():
    mids = [(a + b) / 2 for a, b in zip(C.E2M1_VALUES, C.E2M1_VALUES[1:])]
    x = torch.cat([torch.tensor(mids), -torch.tensor(mids), torch.tensor([6.5, 100.0, -1e9, 0.0, -0.0, -0.1]),
                   torch.empty(500).uniform_(-8, 8, generator=_gen())])
    got = C.e2m1_encode(x).tolist()
    assert got == [_nearest_even_reference(v) for v in x.tolist()]
    # Ties: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0.
    assert C.e2m1_decode(C.e2m1_encode(torch.tensor(mids))).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e2m1_decode_rejects_float_codes():
    with pytest.raises(TypeError, match="integer"):
        C.e2m1_decode(torch.zeros(4))


def test_pack_fp4_byte_order_and_round_trip():
    # Element 2i in the low nibble, 2i + 1 in the high nibble.
    assert C.pack_fp4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = torch.randint(0, 16, (3, 5, 22), generator=_gen(), dtype=torch.uint8)
    packed = C.pack_fp4(codes)
    assert packed.shape == (3, 5, 11) and packed.dtype == torch.uint8
    assert torch.equal(C.unpack_fp4(packed), codes)


def test_pack_fp4_odd_length_and_unpack_wrong_dtype_raise():
    with pytest.raises(ValueError, match="even"):
        C.pack_fp4(torch.zeros(4, 7, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        C.unpack_fp4(torch.zeros(4, 8, dtype=torch.int32))


# --------------------------------------------------------------------------------------------- FP8
def _fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: round-to-nearest costs at most 2^-4 relative for normal values
    (>= 2^-6 after scaling) and half the subnormal step 2^-9 below that, in scaled units."""
    return torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * scale) * (1 + 1e-6)


def test_to_fp8_saturates_and_scales():
    x = torch.tensor([1e6, -1e6, 448.0, 1.0])
    assert C.to_fp8(x, torch.tensor(1.0)).float().tolist() == [448.0, -448.0, 448.0, 1.0]
    assert C.to_fp8(x, torch.tensor(4.0)).float().tolist() == [448.0, -448.0, 112.0, 0.25]


def test_fp8_per_tensor_scale_and_error_bound():
    w = torch.randn(33, 70, generator=_gen()) * 3
    q, scale = C.fp8_per_tensor_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == pytest.approx(w.abs().max().item() / 448, rel=1e-6)
    assert q.float().abs().max().item() == 448.0  # the largest element uses the full range
    assert ((q.float() * scale - w).abs() <= _fp8_error_bound(w, scale)).all()
    qz, sz = C.fp8_per_tensor_quantize(torch.zeros(4, 4))
    assert sz.item() == 1.0 and qz.float().abs().sum() == 0


def test_fp8_block_quantize_partial_edge_blocks():
    w = torch.randn(200, 300, generator=_gen(1)) * torch.logspace(-2, 1, 300)  # columns of varied range
    q, s = C.fp8_block_quantize(w, (128, 128))
    assert q.shape == w.shape and s.shape == (2, 3) and s.dtype == torch.float32
    for i in range(2):
        for j in range(3):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j].item() == pytest.approx(tile.abs().max().item() / 448, rel=1e-6)
    full = C.fp8_block_dequantize(q, s, (128, 128))
    scale_per_elem = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert ((full - w).abs() <= _fp8_error_bound(w, scale_per_elem)).all()


def test_fp8_block_quantize_keeps_leading_expert_dims_and_checks_scale_shape():
    w = torch.randn(3, 40, 24, generator=_gen(2))
    q, s = C.fp8_block_quantize(w, (16, 8))
    assert s.shape == (3, 3, 3)
    for e in range(3):  # stacked experts quantize exactly like each expert alone
        qe, se = C.fp8_block_quantize(w[e], (16, 8))
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)
    with pytest.raises(ValueError, match="scale_inv of shape"):
        C.fp8_block_dequantize(q, s[:, :2], (16, 8))
    with pytest.raises(ValueError, match=r"\[..., N, K\]"):
        C.fp8_block_quantize(torch.randn(8), (16, 8))


def test_fp8_group_quantize_per_token_groups():
    x = torch.randn(3, 5, 200, generator=_gen(3))
    x[0, 0, :128] = 0  # an all-zero group: scale 1, zeros back
    q, s = C.fp8_group_quantize(x, 128)
    assert q.shape == x.shape and s.shape == (3, 5, 2)
    assert s[0, 0, 0].item() == 1.0
    groups_max = torch.stack([q[..., :128].float().abs().amax(-1), q[..., 128:].float().abs().amax(-1)], -1)
    nonzero = s != 1.0
    assert (groups_max[nonzero] == 448.0).all()  # every nonzero group reaches the fp8 maximum
    back = C.fp8_group_dequantize(q, s, 128)
    assert ((back - x).abs() <= _fp8_error_bound(x, s.repeat_interleave(128, -1)[..., :200])).all()
    with pytest.raises(ValueError, match="scales of shape"):
        C.fp8_group_dequantize(q, s[..., :1], 128)


# ------------------------------------------------------------------------------------------ NVFP4
def _fp4_error_bound(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """e2m1's gaps are 0.5 below 2, 1 up to 4, 2 up to 6: rounding costs at most max(0.25, m / 4)
    units at scaled magnitude m (also covers saturating up to 6.375 -> 6, the worst fp8 rounding
    of a block scale)."""
    return torch.maximum(0.25 * step, w.abs() / 4) * (1 + 1e-6)


def test_nvfp4_round_trips_representable_data_exactly():
    g = _gen(4)
    codes = torch.randint(0, 16, (6, 64), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7  # every block holds a 6, so block_amax / 6 is its scale exactly
    block_scales = (torch.rand(6, 4, generator=g) * 100 + 1).to(torch.float8_e4m3fn)
    global_scale = torch.tensor(0.0123)
    w = C.nvfp4_dequantize(C.pack_fp4(codes), block_scales, global_scale)
    packed, bs, gs = C.nvfp4_quantize(w, global_scale)
    assert torch.equal(C.unpack_fp4(packed), codes)
    assert torch.equal(bs.float(), block_scales.float()) and gs.item() == pytest.approx(0.0123)


def test_nvfp4_default_global_scale_and_error_bound():
    w = torch.randn(3, 10, 48, generator=_gen(5)) * 2
    packed, bs, gs = C.nvfp4_quantize(w)
    assert packed.shape == (3, 10, 24) and bs.shape == (3, 10, 3) and bs.dtype == torch.float8_e4m3fn
    assert gs.dim() == 0 and gs.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-6)
    assert bs.float().max().item() == 448.0  # the block holding the amax uses the top fp8 scale
    back = C.nvfp4_dequantize(packed, bs, gs)
    step = (bs.float() * gs).repeat_interleave(16, -1)
    assert ((back - w).abs() <= _fp4_error_bound(w, step)).all()


def test_nvfp4_shape_errors():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        C.nvfp4_quantize(torch.randn(4, 40))
    packed, bs, gs = C.nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="block_scales of shape"):
        C.nvfp4_dequantize(packed, bs[:, :1], gs)


# ------------------------------------------------------------------------------------ E8M0 / MXFP4
def test_e8m0_decode_is_exact_and_encode_inverts_it():
    codes = torch.arange(256).to(torch.uint8)
    values = C.e8m0_decode(codes)
    assert values[:255].tolist() == [2.0 ** (c - 127) for c in range(255)]
    assert torch.isnan(values[255])
    assert torch.equal(C.e8m0_encode(values[:255]), codes[:255])


def test_e8m0_encode_rounds_up_to_a_power_of_two():
    s = torch.exp2(torch.empty(1000).uniform_(-60, 60, generator=_gen(6)))
    back = C.e8m0_decode(C.e8m0_encode(s))
    assert (back >= s).all() and (back < 2 * s).all()
    assert C.e8m0_encode(torch.tensor([0.0, 1e-45, 3e38])).tolist() == [0, 0, 254]  # clamped range


def test_mxfp4_round_trip_and_error_bound():
    g = _gen(7)
    codes = torch.randint(0, 16, (2, 5, 64), generator=g, dtype=torch.uint8)
    codes[..., ::32] = 15  # every block holds a -6: its scale is exactly the stored power of two
    scales = torch.randint(100, 150, (2, 5, 2), generator=g).to(torch.uint8)
    w = C.mxfp4_dequantize(C.pack_fp4(codes), scales)
    packed, s = C.mxfp4_quantize(w)
    assert torch.equal(C.unpack_fp4(packed), codes) and torch.equal(s, scales)

    x = torch.randn(4, 96, generator=g) * 5
    packed, s = C.mxfp4_quantize(x)
    assert packed.shape == (4, 48) and s.shape == (4, 3)
    back = C.mxfp4_dequantize(packed, s)
    step = C.e8m0_decode(s).repeat_interleave(32, -1)
    assert ((back - x).abs() <= _fp4_error_bound(x, step)).all()
    assert (x.abs() <= 6 * step).all()  # the scale rounds up, so nothing saturates


def test_mxfp4_shape_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        C.mxfp4_quantize(torch.randn(2, 48))
    with pytest.raises(TypeError, match="uint8"):
        C.e8m0_decode(torch.zeros(3, dtype=torch.int32))


# ------------------------------------------------------------------------------------ GPTQ storage
def test_gptq_row_and_column_packing_bit_layout():
    codes = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]], dtype=torch.uint8)  # [K=8, N=1]
    word = sum(c << (4 * j) for j, c in enumerate([1, 2, 3, 4, 5, 6, 7, 15]))  # row j in bits 4j..
    signed = word - 2**32 if word >= 2**31 else word
    assert C.gptq_pack_rows(codes).tolist() == [[signed]]
    assert C.gptq_pack_cols(codes.t()).tolist() == [[signed]]


def test_gptq_pack_unpack_round_trip():
    g = _gen(8)
    codes = torch.randint(0, 16, (64, 24), generator=g, dtype=torch.uint8)
    q = C.gptq_pack_rows(codes)
    assert q.dtype == torch.int32 and q.shape == (8, 24)
    assert torch.equal(C.gptq_unpack_rows(q), codes)
    zeros = torch.randint(0, 16, (4, 24), generator=g, dtype=torch.uint8)
    qz = C.gptq_pack_cols(zeros)
    assert qz.shape == (4, 3) and torch.equal(C.gptq_unpack_cols(qz), zeros)
    with pytest.raises(ValueError, match="multiple of 8"):
        C.gptq_pack_rows(codes[:12])
    with pytest.raises(TypeError, match="int32"):
        C.gptq_unpack_rows(q.to(torch.int64))


@pytest.mark.parametrize("zero_offset", [0, 1])
def test_gptq_dequantize_matches_the_formula_with_act_order(zero_offset):
    g = _gen(9)
    k, n, groups = 32, 16, 4
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 15, (groups, n), generator=g, dtype=torch.uint8)
    scales = torch.rand(groups, n, generator=g).half()
    g_idx = (torch.arange(k) // (k // groups))[torch.randperm(k, generator=g)].int()  # act-order
    w = C.gptq_dequantize(C.gptq_pack_rows(codes), C.gptq_pack_cols(zeros), scales, g_idx, zero_offset)
    assert w.shape == (n, k) and w.dtype == torch.float32
    for kk in range(k):
        gi = int(g_idx[kk])
        for nn in range(n):
            expected = (int(codes[kk, nn]) - (int(zeros[gi, nn]) + zero_offset)) * float(scales[gi, nn])
            assert w[nn, kk].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert torch.equal(C.gptq_default_g_idx(k, 8), torch.arange(k, dtype=torch.int32) // 8)
    with pytest.raises(ValueError, match="g_idx"):
        C.gptq_dequantize(C.gptq_pack_rows(codes), C.gptq_pack_cols(zeros), scales, g_idx[:8])


# ------------------------------------------------------------------------------------ grouped int4
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_quantize_groups_error_bound_and_int4_linear_layout(symmetric):
    w = torch.randn(12, 64, generator=_gen(10))
    w[0, :32] = 0.5  # a constant group: asymmetric keeps it exactly, symmetric within half a step
    codes, scales, offsets = C.int4_quantize_groups(w, 32, symmetric)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scales.shape == (12, 2)
    if symmetric:
        assert torch.equal(offsets, -8 * scales)
    back = (codes.float().view(12, 2, 32) * scales[..., None] + offsets[..., None]).view(12, 64)
    # Half a quantization step, plus fp32 rounding of (w - offset) / scale.
    bound = (scales / 2 * (1 + 1e-5)).repeat_interleave(32, -1) + 1e-6
    assert ((back - w).abs() <= bound).all()
    if not symmetric:
        assert torch.allclose(back[0, :32], w[0, :32], rtol=0, atol=1e-7)
    # The triple is torch_int4_linear's: packing and its dequantization reproduce it.
    assert torch.equal(dequantize_int4(pack_int4(codes), scales, offsets, 32), back)


def test_int4_quantize_groups_rejects_ragged_groups():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        C.int4_quantize_groups(torch.randn(4, 48), 32, True)
