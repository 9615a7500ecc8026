"""``workbench.quantization``'s TensorQuantizer and QuantLinear on real tensors: amax layouts against
hand loops, the fake quantization against the codecs (bit for bit: the same arithmetic), calibration,
the attach helpers, and torch.export keeping the fake-quant ops as nodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.ops.quant import codecs as C
from workbench.quantization import (
    QuantLinear, SequentialQuantizer, TensorQuantizer, apply_pre_quant_scale, attach_kv_quantizers,
    attach_quantizers, calibrating,
)

NVFP4_BLOCKS = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
MXFP4_BLOCKS = {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ amax layouts
def test_amax_layouts_match_hand_loops():
    x = _randn(40, 72)
    assert torch.equal(TensorQuantizer((4, 3)).amax_of(x), x.abs().max())
    per_row = TensorQuantizer(8, axis=0).amax_of(x)
    assert per_row.shape == (40,) and all(per_row[i] == x[i].abs().max() for i in range(40))
    groups = TensorQuantizer(4, block_sizes={-1: 24}).amax_of(x)
    assert groups.shape == (40, 3)
    for i in range(40):
        for g in range(3):
            assert groups[i, g] == x[i, 24 * g: 24 * (g + 1)].abs().max()
    tiles = TensorQuantizer((4, 3), block_sizes={-1: 32, -2: 32}).amax_of(x)  # partial edge tiles
    assert tiles.shape == (2, 3)
    for r in range(2):
        for c in range(3):
            assert tiles[r, c] == x[32 * r: 32 * (r + 1), 32 * c: 32 * (c + 1)].abs().max()
    # FP4's block scales are dynamic: its amax is the one global value
    assert TensorQuantizer((2, 1), block_sizes=NVFP4_BLOCKS).amax_of(x).dim() == 0


def test_collect_keeps_the_running_max_and_rejects_another_layout():
    q = TensorQuantizer(4, block_sizes={-1: 8})
    a, b = _randn(4, 16, seed=1), _randn(4, 16, seed=2)
    q.collect(a)
    q.collect(b)
    assert torch.equal(q.amax, torch.maximum(q.amax_of(a), q.amax_of(b)))
    with pytest.raises(ValueError, match="reset_amax"):
        q.collect(_randn(4, 32))


def test_bad_settings_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="scale_bits"):
        TensorQuantizer((2, 1))
    with pytest.raises(ValueError, match="not both"):
        TensorQuantizer(8, axis=0, block_sizes={-1: 32})
    with pytest.raises(ValueError, match="num_bits"):
        TensorQuantizer((5, 2))
    with pytest.raises(ValueError, match="num_bits"):
        TensorQuantizer(16)


# ------------------------------------------------------------------------------------- fake quant
def test_fp8_fake_quant_is_the_codec_round_trip():
    x = _randn(8, 64)
    q = TensorQuantizer((4, 3))
    q.collect(x)
    scale = x.abs().max() / 448
    assert torch.equal(q(x), C.to_fp8(x, scale).float() * scale)
    per_tile = TensorQuantizer((4, 3), block_sizes={-1: 32, -2: 4})
    per_tile.collect(x)
    w8, scale_inv = C.fp8_block_quantize(x, (4, 32))
    assert torch.equal(per_tile(x), C.fp8_block_dequantize(w8, scale_inv, (4, 32)))


def test_nvfp4_and_mxfp4_fake_quant_are_the_codec_round_trips():
    x = _randn(4, 64)
    nv = TensorQuantizer((2, 1), block_sizes=NVFP4_BLOCKS)
    nv.collect(x)
    packed, scales, gs = C.nvfp4_quantize(x, x.abs().max() / (6 * 448), 16)
    assert torch.equal(nv(x), C.nvfp4_dequantize(packed, scales, gs, 16))
    mx = TensorQuantizer((2, 1), block_sizes=MXFP4_BLOCKS)  # needs no calibration
    assert torch.equal(mx(x), C.mxfp4_dequantize(*C.mxfp4_quantize(x, 32), 32))


def test_int_fake_quant_rounds_to_the_grid():
    x = _randn(6, 32)
    q = TensorQuantizer(8, axis=0)
    q.collect(x)
    scale = (x.abs().amax(dim=1) / 127)[:, None]
    y = q(x)
    assert torch.equal(y, torch.round(x / scale) * scale)  # exact: the same two fp32 ops
    assert ((y - x).abs() <= scale / 2 + 1e-7).all()


def test_uncalibrated_and_disabled_quantizers():
    x = _randn(2, 16)
    with pytest.raises(RuntimeError, match="calibrate"):
        TensorQuantizer((4, 3))(x)
    off = TensorQuantizer(8, enabled=False)
    assert off(x) is x
    off.pre_quant_scale = torch.full((16,), 2.0)  # weight-only AWQ: the scale applies, quantization not
    assert torch.equal(off(x), 2 * x)
    assert hasattr(off, "_pre_quant_scale") and not hasattr(off, "_bias_value")
    off.pre_quant_scale = None
    assert not hasattr(off, "_pre_quant_scale")


# ------------------------------------------------------------------------------ modules and calibration
def test_attach_quantizers_keeps_the_module_and_adds_modelopt_keys():
    lin = nn.Linear(64, 32)
    weight = lin.weight
    out = attach_quantizers(lin, "fp8")
    assert out is lin and isinstance(lin, QuantLinear) and lin.weight is weight
    keys = set(lin.state_dict())
    assert {"weight", "bias", "weight_quantizer._amax"} <= keys
    assert torch.equal(lin.weight_quantizer.amax, weight.detach().abs().max())
    x = _randn(3, 64)
    with calibrating(lin):
        assert torch.equal(lin(x), F.linear(x, weight, lin.bias))  # calibration passes values through
    assert torch.equal(lin.input_quantizer.amax, x.abs().max())
    fq = torch.ops.workbench.torch_fake_quant_fp8
    expected = F.linear(fq(x, x.abs().max()), fq(weight, weight.abs().max()), lin.bias)
    assert torch.equal(lin(x), expected)


def test_a_fresh_quantized_linear_loads_a_calibrated_state_dict():
    src = attach_quantizers(nn.Linear(64, 16), "int4_awq", block_size=32)
    apply_pre_quant_scale(src, torch.linspace(0.5, 2.0, 64))
    dst = attach_quantizers(nn.Linear(64, 16), "int4_awq", block_size=32)
    dst.weight_quantizer.reset_amax()
    dst.load_state_dict(src.state_dict())  # strict: every key, the optional buffers included
    assert torch.equal(dst.input_quantizer.pre_quant_scale, src.input_quantizer.pre_quant_scale)
    x = _randn(3, 64)
    assert torch.equal(dst(x), src(x))


def test_attach_rejects_linear_subclasses_and_unknown_formats():
    class Custom(nn.Linear):
        pass

    with pytest.raises(TypeError, match="nn.Linear"):
        attach_quantizers(Custom(4, 4), "fp8")
    with pytest.raises(ValueError, match="unsupported quantization format 'fp8_pc_pt'"):
        attach_quantizers(nn.Linear(4, 4), "fp8_pc_pt")
    with pytest.raises(ValueError, match="KV cache format"):
        attach_kv_quantizers(nn.Module(), "FP16")


def test_w4a8_weight_quantizer_is_int4_then_fp8():
    lin = attach_quantizers(nn.Linear(64, 8), "w4a8_awq", block_size=32)
    wq = lin.weight_quantizer
    assert isinstance(wq, SequentialQuantizer) and [q.num_bits for q in wq] == [4, (4, 3)]
    w = lin.weight.detach()
    step = torch.repeat_interleave(w.abs().reshape(8, 2, 32).amax(-1) / 7, 32, dim=1)
    int4 = torch.round(w / step).clamp(-8, 7) * step
    assert torch.equal(wq(w), torch.ops.workbench.torch_fake_quant_fp8(int4, w.abs().max()))


def test_apply_pre_quant_scale_keeps_the_float_output():
    lin = attach_quantizers(nn.Linear(64, 16), "int4_awq", block_size=32)
    lin.weight_quantizer.disable()
    x = _randn(5, 64)
    before = lin(x)
    apply_pre_quant_scale(lin, torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5)
    # (x * s) @ (W / s).T: one extra multiply and divide per element, fp32 -> a few ulps
    torch.testing.assert_close(lin(x), before, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="positive"):
        apply_pre_quant_scale(lin, -torch.ones(64))


@pytest.mark.parametrize("fmt,op", [("fp8", "torch_fake_quant_fp8"), ("nvfp4", "torch_fake_quant_nvfp4")])
def test_export_keeps_the_fake_quant_ops(fmt, op):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    for m in (model[0], model[2]):
        attach_quantizers(m, fmt)
    x = _randn(4, 32)
    with calibrating(model):
        model(x)
    ep = torch.export.export(model, (x,), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(getattr(torch.ops.workbench, op).default) == 4  # input + weight, two layers
    assert torch.equal(ep.module()(x), model(x))
