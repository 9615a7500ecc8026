"""The quant_utils functions that read formats, scaling factors and weights, on real ``nn.Linear``
modules with quantizers attached and calibrated from real tensors.

Round-trip tolerances are each format's rounding bound (derived in ``_bound``), never looser; where
this package and the codecs compute the same thing the comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.ops.quant import codecs as C
from workbench.ops.quant.int4 import pack_int4, torch_int4_linear
from workbench.quantization import (
    SUPPORTED_FORMATS, TensorQuantizer, apply_pre_quant_scale, attach_quantizers, calibrating, from_quantized_weight,
    get_activation_scaling_factor, get_prequant_scaling_factor, get_quantization_format, get_scaling_factor,
    get_scaling_factor_from_weight, get_weight_block_size, get_weight_scaling_factor, get_weight_scaling_factor_2,
    maybe_transpose_expert_weight_dimensions, pack_int4_in_uint8, to_quantized_weight, unpack_int4_from_uint8,
)

# Block sizes small enough for the 64-column test weights.
BLOCK = {"fp8_pb_wo": 32, "int4_awq": 32, "w4a8_awq": 32, "nvfp4": 16, "nvfp4_awq": 16, "mxfp4": 32}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(fmt, n=48, k=64, seed=0):
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_randn(n, k, seed=seed))
    attach_quantizers(lin, fmt, block_size=BLOCK.get(fmt))
    if fmt == "nvfp4_awq":
        apply_pre_quant_scale(lin, torch.linspace(0.5, 2.0, k))
    return lin


# --------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_get_quantization_format_reads_the_attached_quantizers(fmt):
    lin = _linear(fmt)
    assert get_quantization_format(lin) == fmt
    parent = nn.Sequential(nn.LayerNorm(64), nn.Sequential(lin))  # first quantized descendant
    assert get_quantization_format(parent) == fmt


def test_get_quantization_format_none_and_unsupported_quantizers():
    assert get_quantization_format(nn.Linear(4, 4)) is None
    lin = _linear("fp8")
    lin.weight_quantizer.disable()
    assert get_quantization_format(lin) is None
    lin.weight_quantizer = TensorQuantizer((4, 3), axis=0)
    with pytest.raises(ValueError, match="fp8_pc_pt"):
        get_quantization_format(lin)
    lin.weight_quantizer = TensorQuantizer(4)
    with pytest.raises(ValueError, match="int4 is supported in groups only"):
        get_quantization_format(lin)


def test_stacked_expert_weights_have_their_own_quantizers():
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(_randn(4, 32, 64))
    experts.gate_up_proj_weight_quantizer = TensorQuantizer((2, 1), block_sizes={-1: 16, "type": "dynamic",
                                                                                 "scale_bits": (4, 3)})
    experts.gate_up_proj_input_quantizer = TensorQuantizer((2, 1), block_sizes={-1: 16, "type": "dynamic",
                                                                                "scale_bits": (4, 3)})
    experts.gate_up_proj_weight_quantizer.collect(experts.gate_up_proj)
    assert get_quantization_format(experts) == "nvfp4"
    assert get_weight_block_size(experts, "gate_up_proj") == 16
    scales = get_weight_scaling_factor(experts, "gate_up_proj")
    assert scales.shape == (4, 32, 4) and scales.dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------------------------- scaling factors
def test_get_scaling_factor_from_weight_is_amax_over_bound_per_group():
    w = _randn(6, 64)
    w[2, 32:] = 0  # an all-zero group gets scale 1, not 0
    got = get_scaling_factor_from_weight(w, 32)
    assert got.shape == (6, 2)
    for i in range(6):
        for g in range(2):
            expected = w[i, 32 * g: 32 * (g + 1)].abs().max() / 7
            assert got[i, g] == (expected if expected > 0 else 1.0)
    rows = get_scaling_factor_from_weight(w, 0)
    assert torch.equal(rows, torch.stack([w[i].abs().max() / 127 for i in range(6)]))
    with pytest.raises(ValueError, match="multiple of group_size"):
        get_scaling_factor_from_weight(w, 48)
    with pytest.raises(ValueError, match="2-D"):
        get_scaling_factor_from_weight(w[None], 32)


def test_get_scaling_factor_per_number_format():
    x = _randn(8, 32)
    for num_bits, bound in [((4, 3), 448.0), (8, 127.0), (4, 7.0)]:
        q = TensorQuantizer(num_bits)
        assert get_scaling_factor(q) is None  # not calibrated
        q.collect(x)
        assert get_scaling_factor(q) == x.abs().max() / bound
        q.disable()
        assert get_scaling_factor(q) is None
    fp4 = TensorQuantizer((2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    fp4.collect(x)
    assert get_scaling_factor(fp4) == x.abs().max() / (6 * 448)  # the NVFP4 global scale
    bad = TensorQuantizer(8)
    bad.amax = torch.tensor(-1.0)
    with pytest.raises(ValueError, match="non-negative"):
        get_scaling_factor(bad)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_weight_scaling_factors_and_block_size(fmt):
    lin = _linear(fmt)
    w = lin.weight.detach()
    sf, sf2, block = get_weight_scaling_factor(lin), get_weight_scaling_factor_2(lin), get_weight_block_size(lin)
    if fmt == "fp8":
        assert sf == w.abs().max() / 448 and sf2 is None and block == 0
    elif fmt == "fp8_pb_wo":
        assert torch.equal(sf, C.fp8_block_quantize(w, (32, 32))[1]) and sf2 is None and block == 32
    elif fmt in ("int8_sq", "int8_wo"):
        assert torch.equal(sf, get_scaling_factor_from_weight(w, 0)) and sf2 is None and block == 0
    elif fmt == "int4_awq":
        assert torch.equal(sf, get_scaling_factor_from_weight(w, 32)) and sf2 is None and block == 32
    elif fmt == "w4a8_awq":
        assert torch.equal(sf, get_scaling_factor_from_weight(w, 32)) and block == 32
        assert sf2 == w.abs().max() / 448
    elif fmt in ("nvfp4", "nvfp4_awq"):
        assert sf2 == w.abs().max() / (6 * 448) and block == 16
        assert torch.equal(sf.view(torch.uint8), C.nvfp4_quantize(w, sf2, 16)[1].view(torch.uint8))
    else:
        assert torch.equal(sf, C.mxfp4_quantize(w, 32)[1]) and sf2 is None and block == 32


def test_activation_and_prequant_scaling_factors():
    x = _randn(16, 64, seed=5)
    fp8 = _linear("fp8")
    with calibrating(fp8):
        fp8(x)
        fp8(2 * x)  # the running max
    assert get_activation_scaling_factor(fp8) == 2 * x.abs().max() / 448
    nv = _linear("nvfp4")
    with calibrating(nv):
        nv(x)
    assert get_activation_scaling_factor(nv) == x.abs().max() / (6 * 448)
    assert get_activation_scaling_factor(_linear("int4_awq")) is None  # weight only
    assert get_activation_scaling_factor(nn.Linear(4, 4)) is None
    assert get_prequant_scaling_factor(fp8) is None
    awq = _linear("int4_awq")
    scale = torch.linspace(0.5, 2.0, 64)
    apply_pre_quant_scale(awq, scale)
    assert torch.equal(get_prequant_scaling_factor(awq), scale)
    awq.input_quantizer.pre_quant_scale = torch.zeros(64)
    with pytest.raises(ValueError, match="non-positive"):
        get_prequant_scaling_factor(awq)


# --------------------------------------------------------------------------------- quantized weights
def _bound(fmt, w, sf, sf2, block):
    """Largest |w - dequantized| each format's rounding allows, per element."""
    if fmt in ("fp8", "fp8_pb_wo"):
        # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normals; subnormals are spaced
        # 2^-9 (times the scale) -> 2^-10 absolute
        scale = sf if fmt == "fp8" else C.fp8_block_dequantize(torch.ones_like(w).to(torch.float8_e4m3fn), sf,
                                                               (block, block))
        return w.abs() * 2 ** -4 + scale * 2 ** -10
    if fmt in ("int8_sq", "int8_wo"):
        return (sf / 2)[:, None].expand_as(w)  # round to nearest, nothing clips (|w| <= amax)
    if fmt in ("int4_awq", "w4a8_awq"):
        return (sf / 2).repeat_interleave(block, dim=1)
    if fmt in ("nvfp4", "nvfp4_awq"):
        # one e2m1 step is block_scale * global; the largest gap of the e2m1 grid is 2 (4 -> 6), so
        # rounding errs by at most 1 step; the fp8 rounding of the block scale lets block_amax reach
        # 6.4 steps, saturating at 6 (0.4 step)
        return (sf.float() * sf2).repeat_interleave(block, dim=1)
    # mxfp4: the power-of-two scale is >= block_amax / 6, nothing saturates; largest half-gap 1 step
    return C.e8m0_decode(sf).repeat_interleave(block, dim=1)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_to_and_from_quantized_weight_round_trip_within_the_format_bound(fmt):
    lin = _linear(fmt)
    w = lin.weight.detach()
    sf, sf2, block = get_weight_scaling_factor(lin), get_weight_scaling_factor_2(lin), get_weight_block_size(lin)
    q = to_quantized_weight(w, sf, fmt, sf2, block or None)
    expected_dtype = {"fp8": torch.float8_e4m3fn, "fp8_pb_wo": torch.float8_e4m3fn, "int8_sq": torch.int8,
                      "int8_wo": torch.int8}.get(fmt, torch.uint8)
    assert q.dtype == expected_dtype
    assert q.shape == {"int4_awq": (24, 64), "w4a8_awq": (24, 64), "nvfp4": (48, 32), "nvfp4_awq": (48, 32),
                       "mxfp4": (48, 32)}.get(fmt, (48, 64))
    back = from_quantized_weight(q, sf, fmt, torch.float32, weights_scaling_factor2=sf2, block_size=block or None)
    assert back.dtype == torch.float32 and back.shape == w.shape
    err = (back - w).abs()
    assert (err <= _bound(fmt, w, sf, sf2, block) * (1 + 1e-6)).all(), float(err.max())
    assert err.max() > 0  # a lossy format: the round trip really went through it
    if fmt in ("nvfp4", "nvfp4_awq"):  # the codec's own round trip, bit for bit
        assert torch.equal(back, C.nvfp4_dequantize(*C.nvfp4_quantize(w, sf2, 16), 16))
    if fmt == "mxfp4":
        assert torch.equal(back, C.mxfp4_dequantize(*C.mxfp4_quantize(w, 32), 32))
        assert torch.equal(to_quantized_weight(w, None, fmt, block_size=32), q)  # scales recomputed
    if fmt in ("int8_sq", "int8_wo"):
        assert torch.equal(q, torch.round(w / sf[:, None]).to(torch.int8))


def test_fp8_stored_as_int8_bytes_and_per_expert_scales():
    w = _randn(3, 16, 32)
    scales = w.abs().amax(dim=(1, 2)) / 448  # one per expert
    q = to_quantized_weight(w, scales, "fp8")
    for e in range(3):
        assert torch.equal(q[e].view(torch.uint8), C.to_fp8(w[e], scales[e]).view(torch.uint8))
    back = from_quantized_weight(q.view(torch.int8), scales, "fp8", torch.float32)  # safetensors-style bytes
    assert torch.equal(back, q.float() * scales[:, None, None])


def test_nvfp4_per_expert_global_scales():
    w = _randn(2, 8, 32)
    w[1] *= 100  # very different ranges: one global scale each
    gs = w.abs().amax(dim=(1, 2)) / (6 * 448)
    block_scales = torch.stack([C.nvfp4_quantize(w[e], gs[e], 16)[1].view(torch.uint8) for e in range(2)])
    block_scales = block_scales.view(torch.float8_e4m3fn)
    q = to_quantized_weight(w, block_scales, "nvfp4", gs, 16)
    back = from_quantized_weight(q, block_scales, "nvfp4", torch.float32, weights_scaling_factor2=gs)
    for e in range(2):
        assert torch.equal(q[e], C.nvfp4_quantize(w[e], gs[e], 16)[0])
        assert torch.equal(back[e], C.nvfp4_dequantize(q[e], block_scales[e], gs[e], 16))


def test_pack_int4_in_uint8_pairs_output_rows_signed():
    # rows 0 and 1 share a byte: row 0 low nibble, row 1 high nibble, two's complement
    w = torch.tensor([[1.0, -8.0, 7.0, 0.0], [-1.0, 3.0, -2.0, 5.0]])
    packed = pack_int4_in_uint8(w, torch.ones(2, 1))
    assert packed.tolist() == [[0xF1, 0x38, 0xE7, 0x50]]
    assert torch.equal(unpack_int4_from_uint8(packed), w.to(torch.int8))
    experts = _randn(3, 8, 64)
    sf = torch.stack([get_scaling_factor_from_weight(experts[e], 32) for e in range(3)])
    packed3 = pack_int4_in_uint8(experts, sf)
    assert packed3.shape == (3, 4, 64)
    for e in range(3):
        assert torch.equal(packed3[e], pack_int4_in_uint8(experts[e], sf[e]))
    with pytest.raises(ValueError, match="even N"):
        pack_int4_in_uint8(_randn(3, 64), torch.ones(3, 2))


def test_int4_awq_weight_runs_in_the_workbench_int4_linear():
    """The docstring's recipe from ModelOpt's packing to ``pack_int4`` + ``torch_int4_linear``."""
    lin = _linear("int4_awq")
    sf = get_weight_scaling_factor(lin)
    packed = to_quantized_weight(lin.weight.detach(), sf, "int4_awq")
    codes = unpack_int4_from_uint8(packed).to(torch.int16) + 8
    x = _randn(5, 64, seed=9)
    got = torch_int4_linear(x, pack_int4(codes), sf, -8 * sf, 32)
    expected = F.linear(x, from_quantized_weight(packed, sf, "int4_awq", torch.float32))
    # codes * s + (-8 s) vs (codes - 8) * s: the same value up to fp32 rounding of the two forms
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_formats_and_missing_arguments():
    w = _randn(8, 32)
    with pytest.raises(ValueError, match="unsupported quantization format 'fp8_pc_pt'"):
        to_quantized_weight(w, torch.tensor(1.0), "fp8_pc_pt")
    with pytest.raises(ValueError, match="unsupported quantization format 'int3'"):
        from_quantized_weight(w.to(torch.int8), torch.ones(8), "int3", torch.float32)
    with pytest.raises(ValueError, match="weights_scaling_factor2"):
        to_quantized_weight(w, torch.ones(8, 2).to(torch.float8_e4m3fn), "nvfp4", block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        to_quantized_weight(w, torch.ones(1, 1), "fp8_pb_wo")
    with pytest.raises(ValueError, match="needs weights_scaling_factor"):
        to_quantized_weight(w, None, "int8_sq")
    # unquantized inputs are only cast
    assert from_quantized_weight(w.half(), torch.ones(8), "fp8", torch.float32).dtype == torch.float32
    assert torch.equal(from_quantized_weight(w, None, "fp8", torch.float32), w)


def test_maybe_transpose_expert_weight_dimensions():
    w = _randn(4, 64, 32)  # (experts, input, output): bmm layout
    block_scales = _randn(4, 4, 32)
    t, s = maybe_transpose_expert_weight_dimensions(w, block_scales)
    assert t.shape == (4, 32, 64) and s.shape == (4, 32, 4)
    assert torch.equal(t[2, 5], w[2, :, 5]) and torch.equal(s[1], block_scales[1].T)
    back, back_s = maybe_transpose_expert_weight_dimensions(t, s)  # self-inverse
    assert torch.equal(back, w) and torch.equal(back_s, block_scales)
    per_expert = torch.ones(4)
    assert maybe_transpose_expert_weight_dimensions(w, per_expert)[1] is per_expert
    flat = _randn(8, 16)
    assert maybe_transpose_expert_weight_dimensions(flat)[0] is flat
    assert maybe_transpose_expert_weight_dimensions(w, is_bmm_expert_weight=False)[0] is w
    # input dim last -> NVFP4 blocks run along the input dim, then back to the bmm layout
    gs = t.abs().max() / (6 * 448)
    packed, scales, _ = C.nvfp4_quantize(t, gs, 16)
    deq, step = maybe_transpose_expert_weight_dimensions(C.nvfp4_dequantize(packed, scales, gs, 16),
                                                         (scales.float() * gs).repeat_interleave(16, dim=-1))
    assert deq.shape == w.shape and ((deq - w).abs() <= step * (1 + 1e-6)).all()  # the NVFP4 bound above
