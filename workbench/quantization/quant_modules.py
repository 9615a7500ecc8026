"""Attaching quantizers to real modules and calibrating them from real tensors.

``attach_quantizers(linear, "nvfp4")`` turns a plain ``nn.Linear`` into a ``QuantLinear`` in place
(the same object, its parameters and state-dict keys unchanged, plus ``weight_quantizer`` /
``input_quantizer`` / ``output_quantizer``) whose forward is
``output_quantizer(F.linear(input_quantizer(x), weight_quantizer(weight), bias))`` -- ModelOpt's
QuantLinear, so an exported model carries the fake-quant ops. The class swap is what ModelOpt does
too: the module stays where it is in its parent, and hooks or parametrizations would rename the
weight in the state dict.

``attach_kv_quantizers(attention, "FP8")`` adds ``k_bmm_quantizer`` / ``v_bmm_quantizer``; they hold
the KV-cache settings and calibrated amax that the KV-cache utilities read (HF attention modules do
not call them: calibrate them with ``quantizer.collect(k)`` from real keys/values).

Calibration: ``calibrate_weights(model)`` sets every weight quantizer's amax from its weight;
``with calibrating(model): model(batch)`` records activation amax over real inputs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .formats import (
    KV_CACHE_FP8,
    KV_CACHE_INT8,
    KV_CACHE_NVFP4,
    QUANTIZATION_FP8,
    QUANTIZATION_FP8_PB_WO,
    QUANTIZATION_INT4_AWQ,
    QUANTIZATION_INT8_SQ,
    QUANTIZATION_INT8_WO,
    QUANTIZATION_MXFP4,
    QUANTIZATION_NVFP4,
    QUANTIZATION_NVFP4_AWQ,
    QUANTIZATION_W4A8_AWQ,
    check_format,
)
from .quantizer import SequentialQuantizer, TensorQuantizer

# Block sizes each format uses when none is given (ModelOpt's defaults).
DEFAULT_BLOCK_SIZE = {
    QUANTIZATION_FP8_PB_WO: 128,
    QUANTIZATION_INT4_AWQ: 128,
    QUANTIZATION_W4A8_AWQ: 128,
    QUANTIZATION_NVFP4: 16,
    QUANTIZATION_NVFP4_AWQ: 16,
    QUANTIZATION_MXFP4: 32,
}


def _fp4(scale_bits: Tuple[int, int], block: int) -> TensorQuantizer:
    return TensorQuantizer((2, 1), block_sizes={-1: block, "type": "dynamic", "scale_bits": scale_bits})


def _off() -> TensorQuantizer:
    return TensorQuantizer(8, enabled=False)


def make_quantizers(quantization: str, block_size: Optional[int] = None) -> Tuple[nn.Module, TensorQuantizer]:
    """Fresh (weight quantizer, input quantizer) configured for ``quantization`` (a
    ``SUPPORTED_FORMATS`` name); ``block_size`` overrides the format's default group/block size."""
    check_format(quantization, "make_quantizers")
    block = block_size or DEFAULT_BLOCK_SIZE.get(quantization, 0)
    if quantization == QUANTIZATION_FP8:
        return TensorQuantizer((4, 3)), TensorQuantizer((4, 3))
    if quantization == QUANTIZATION_FP8_PB_WO:
        return TensorQuantizer((4, 3), block_sizes={-1: block, -2: block}), _off()
    if quantization == QUANTIZATION_INT8_SQ:
        return TensorQuantizer(8, axis=0), TensorQuantizer(8)
    if quantization == QUANTIZATION_INT8_WO:
        return TensorQuantizer(8, axis=0), _off()
    if quantization == QUANTIZATION_INT4_AWQ:
        return TensorQuantizer(4, block_sizes={-1: block}), TensorQuantizer(8, enabled=False)
    if quantization == QUANTIZATION_W4A8_AWQ:
        weight = SequentialQuantizer(TensorQuantizer(4, block_sizes={-1: block}), TensorQuantizer((4, 3)))
        return weight, TensorQuantizer((4, 3))
    if quantization in (QUANTIZATION_NVFP4, QUANTIZATION_NVFP4_AWQ):
        return _fp4((4, 3), block), _fp4((4, 3), block)
    return _fp4((8, 0), block), _off()  # mxfp4: weight only


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs its quantizers (made by ``attach_quantizers``)."""

    weight_quantizer: Union[TensorQuantizer, SequentialQuantizer]
    input_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.input_quantizer(input)
        y = F.linear(x, self.weight_quantizer(self.weight), self.bias)
        return self.output_quantizer(y)


def attach_quantizers(linear: nn.Linear, quantization: str, *, block_size: Optional[int] = None) -> QuantLinear:
    """Make ``linear`` a ``QuantLinear`` quantized as ``quantization``, in place (returned too).

    The weight quantizer is calibrated from the weight at once (weights are known); activations need
    ``calibrating`` over real inputs for the formats that quantize them. For ``nvfp4_awq`` set the
    AWQ scale afterwards with ``apply_pre_quant_scale``.
    """
    if type(linear) not in (nn.Linear, QuantLinear):
        raise TypeError(
            f"attach_quantizers: expected an nn.Linear, got {type(linear).__name__} (subclasses "
            "may have their own forward, which the quantizers would not be part of)"
        )
    weight_q, input_q = make_quantizers(quantization, block_size)
    linear.__class__ = QuantLinear
    linear.weight_quantizer = weight_q
    linear.input_quantizer = input_q
    linear.output_quantizer = _off()
    calibrate_weights(linear)
    return cast(QuantLinear, linear)  # its class was swapped above


def quantize_linears(
    model: nn.Module, quantization: str, *, exclude: Tuple[str, ...] = ("lm_head",), block_size: Optional[int] = None
) -> list:
    """``attach_quantizers`` on every ``nn.Linear`` of ``model`` whose name's last part is not in
    ``exclude`` (those stay plain and count as unquantized layers). Returns the quantized names."""
    names = [
        name for name, m in model.named_modules() if type(m) is nn.Linear and name.rsplit(".", 1)[-1] not in exclude
    ]
    for name in names:
        attach_quantizers(cast(nn.Linear, model.get_submodule(name)), quantization, block_size=block_size)
    return names


def attach_kv_quantizers(attention: nn.Module, kv_cache: str = KV_CACHE_FP8, *, affine: bool = False) -> nn.Module:
    """Add ``k_bmm_quantizer`` / ``v_bmm_quantizer`` for a ``"FP8"``, ``"INT8"`` or ``"NVFP4"`` KV
    cache to ``attention`` (in place, returned). ``affine`` gives them a zero ``bias_value`` (the
    NVFP4 affine KV cache's per-tensor offset), to be set from calibration."""
    makers = {
        KV_CACHE_FP8: lambda: TensorQuantizer((4, 3)),
        KV_CACHE_INT8: lambda: TensorQuantizer(8),
        KV_CACHE_NVFP4: lambda: _fp4((4, 3), 16),
    }
    if kv_cache not in makers:
        raise ValueError(f"attach_kv_quantizers: unsupported KV cache format {kv_cache!r}; use one of {list(makers)}")
    for name in ("k_bmm_quantizer", "v_bmm_quantizer"):
        q = makers[kv_cache]()
        if affine:
            q.bias_value = torch.zeros(())
        setattr(attention, name, q)
    return attention


def _tensor_quantizers(module: nn.Module) -> Iterator[TensorQuantizer]:
    return (m for m in module.modules() if isinstance(m, TensorQuantizer))


def calibrate_weights(module: nn.Module) -> None:
    """Reset and recompute the amax of every ``QuantLinear`` weight quantizer under ``module``."""
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.weight_quantizer.reset_amax()
            m.weight_quantizer.collect(m.weight)  # a SequentialQuantizer calibrates each stage on it


@contextmanager
def calibrating(module: nn.Module):
    """Inside the block, every enabled quantizer under ``module`` records the running amax of what
    it sees and passes values through unquantized (ModelOpt's calibration mode)."""
    quantizers = [q for q in _tensor_quantizers(module) if q.is_enabled]
    for q in quantizers:
        q.collecting = True
    try:
        with torch.no_grad():
            yield module
    finally:
        for q in quantizers:
            q.collecting = False


def apply_pre_quant_scale(linear: QuantLinear, pre_quant_scale: torch.Tensor) -> None:
    """Smooth ``linear`` (AWQ / SmoothQuant): inputs get multiplied by ``pre_quant_scale`` [K] and the
    weight divided by it, column-wise, so the float output is unchanged; the weight amax is
    recalibrated (the weight changed)."""
    k = linear.in_features
    if pre_quant_scale.shape != (k,) or not bool((pre_quant_scale > 0).all()):
        raise ValueError(
            f"apply_pre_quant_scale: needs a positive scale of shape ({k},), got {tuple(pre_quant_scale.shape)}"
        )
    with torch.no_grad():
        linear.weight.div_(pre_quant_scale.to(linear.weight.dtype))
    linear.input_quantizer.pre_quant_scale = pre_quant_scale
    calibrate_weights(linear)
