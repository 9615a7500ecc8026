"""Weights to and from their stored (quantized, packed) form, as ModelOpt checkpoints hold them.

Layouts of ``to_quantized_weight(weight [..., N, K], ...)`` (leading dims: stacked experts):

=============  ============================  ==========================================================
format         quantized weight              scaling factors (``get_weight_scaling_factor`` shapes)
=============  ============================  ==========================================================
fp8            float8_e4m3fn [..., N, K]     0-d, or [E] per expert
fp8_pb_wo      float8_e4m3fn [..., N, K]     [..., ceil(N/b), ceil(K/b)], ``block_size`` b
int8_sq / _wo  int8 [..., N, K]              [..., N]
int4_awq       uint8 [..., N/2, K]           [..., N, K/g]; two *output rows* per byte (see
 / w4a8_awq                                  ``pack_int4_in_uint8``)
nvfp4 / _awq   uint8 [..., N, K/2]           fp8 [..., N, K/16] + ``weights_scaling_factor2`` 0-d / [E]
mxfp4          uint8 [..., N, K/2]           uint8 e8m0 [..., N, K/32] (optional: recomputed if None)
=============  ============================  ==========================================================

Rounding is to nearest (ties to even for fp4 and the integer formats' ``torch.round``), saturating.
The bit-level work (fp8 casts, e2m1 codes, fp4 nibble order, e8m0, NVFP4/MXFP4 blocks) is
``workbench.ops.quant.codecs``'.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from ..ops.quant import codecs
from .formats import (
    INT4_FORMATS,
    INT8_FORMATS,
    NVFP4_FORMATS,
    QUANTIZATION_FP8,
    QUANTIZATION_FP8_PB_WO,
    QUANTIZATION_MXFP4,
    check_format,
)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _per_expert(scale: torch.Tensor, weight: torch.Tensor, what: str) -> torch.Tensor:
    """A 0-d scale as is; a per-expert [E] scale of a [E, N, K] weight as [E, 1, 1]."""
    scale = scale.float()
    if scale.dim() == 0 or scale.numel() == 1:
        return scale.reshape(())
    if weight.dim() == 3 and scale.numel() == weight.shape[0]:
        return scale.reshape(-1, 1, 1)
    raise ValueError(
        f"{what}: a per-tensor scale must be 0-d (or [E] for [E, N, K] expert weights); got scale "
        f"{tuple(scale.shape)} for weight {tuple(weight.shape)}"
    )


def _group_size(k: int, scale: torch.Tensor, block_size: Optional[int], what: str) -> int:
    """The block along K implied by per-group scales [..., K/g] (checked against ``block_size``)."""
    groups = scale.shape[-1] if scale.dim() else 0
    if not groups or k % groups or (block_size and block_size != k // groups):
        raise ValueError(
            f"{what}: per-group scales {tuple(scale.shape)} do not divide K={k} into groups"
            + (f" of block_size={block_size}" if block_size else "")
        )
    return k // groups


def _expand_groups(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.float().repeat_interleave(k // scale.shape[-1], dim=-1)


def pack_int4_in_uint8(weight: torch.Tensor, weights_scaling_factor: torch.Tensor) -> torch.Tensor:
    """Packs the INT4 weights into uint8 tensor.

    weight [..., N, K] float, weights_scaling_factor [..., N, K/g] -> uint8 [..., N/2, K]: the
    signed code ``round(w / scale)`` clamped to -8..7, as a two's-complement nibble; byte [r, k]
    holds row 2r in its low nibble and row 2r + 1 in its high nibble (ModelOpt / TensorRT-LLM's
    order: pairs of *output* rows). N must be even.

    Relation to ``workbench/ops/quant/int4.py``'s ``pack_int4`` (what ``torch_int4_linear`` reads):
    that one packs along K, unsigned codes 0..15 in runs of 32 (byte j = code j | code j+16 << 4),
    with ``w = code * scale + offset``. The same weight goes from here to there as
    ``codes = unpack_int4_from_uint8(packed) + 8``, ``pack_int4(codes)``, same scales,
    ``offsets = -8 * scales``.
    """
    *lead, n, k = weight.shape
    if weight.dim() not in (2, 3) or n % 2:
        raise ValueError(
            f"pack_int4_in_uint8: needs a [N, K] or [E, N, K] weight with an even N (two output rows "
            f"per byte), got {tuple(weight.shape)}"
        )
    if tuple(weights_scaling_factor.shape[:-1]) != (*lead, n):
        raise ValueError(
            f"pack_int4_in_uint8: scales {tuple(weights_scaling_factor.shape)} do not match weight "
            f"{tuple(weight.shape)}; expected [..., {n}, K/group]"
        )
    _group_size(k, weights_scaling_factor, None, "pack_int4_in_uint8")
    scale = _nonzero(_expand_groups(weights_scaling_factor, k))
    codes = torch.round(weight.float() / scale).clamp(-8, 7).to(torch.int16) & 0xF
    rows = codes.reshape(*lead, n // 2, 2, k)
    return (rows[..., 0, :] | (rows[..., 1, :] << 4)).to(torch.uint8)


def unpack_int4_from_uint8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4_in_uint8``'s packing: uint8 [..., N/2, K] -> signed codes int8 [..., N, K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4_from_uint8: packed int4 must be uint8, got {packed.dtype}")
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-2).to(torch.int16)  # [..., N/2, 2, K]
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)
    return signed.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def _fp4_codes(weight: torch.Tensor, step: torch.Tensor, block: int) -> torch.Tensor:
    """e2m1 codes packed, for ``weight`` [..., K] divided by per-block ``step`` [..., K/block]."""
    blocks = weight.float().reshape(*weight.shape[:-1], -1, block)
    codes = codecs.e2m1_encode(blocks / _nonzero(step)[..., None]).reshape(weight.shape)
    return codecs.pack_fp4(codes)


def to_quantized_weight(
    weight: torch.Tensor,
    weights_scaling_factor: Optional[torch.Tensor],
    quantization: str,
    weights_scaling_factor2: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """Converts the weight to the quantized (packed) format of ``quantization`` (module docstring),
    dividing by the given scaling factors (those of ``get_weight_scaling_factor`` /
    ``get_weight_scaling_factor_2``)."""
    check_format(quantization, "to_quantized_weight")
    if weights_scaling_factor is not None:
        weights_scaling_factor = weights_scaling_factor.to(weight.device)
    if weights_scaling_factor is None and quantization != QUANTIZATION_MXFP4:
        raise ValueError(f"to_quantized_weight: {quantization} needs weights_scaling_factor")
    if quantization == QUANTIZATION_FP8:
        if weight.dtype == torch.float8_e4m3fn:
            warnings.warn("to_quantized_weight: weight is already float8_e4m3fn; returned as is", stacklevel=2)
            return weight
        assert weights_scaling_factor is not None  # checked above (only mxfp4 may go without)
        return codecs.to_fp8(weight, _per_expert(weights_scaling_factor, weight, "to_quantized_weight"))
    if quantization == QUANTIZATION_FP8_PB_WO:
        if not block_size:
            raise ValueError("to_quantized_weight: fp8_pb_wo needs block_size (the square block edge)")
        assert weights_scaling_factor is not None  # checked above (only mxfp4 may go without)
        scale = codecs.expand_block_scales(
            weights_scaling_factor, weight.shape, (block_size, block_size), "to_quantized_weight: fp8_pb_wo"
        )
        return codecs.to_fp8(weight, _nonzero(scale))
    if quantization in INT8_FORMATS:
        assert weights_scaling_factor is not None  # checked above (only mxfp4 may go without)
        if tuple(weights_scaling_factor.shape) != tuple(weight.shape[:-1]):
            raise ValueError(
                f"to_quantized_weight: int8 scales must be per output row {tuple(weight.shape[:-1])}, "
                f"got {tuple(weights_scaling_factor.shape)}"
            )
        scale = _nonzero(weights_scaling_factor.float()).unsqueeze(-1)
        return torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8)
    if quantization in INT4_FORMATS:
        assert weights_scaling_factor is not None  # checked above (only mxfp4 may go without)
        return pack_int4_in_uint8(weight, weights_scaling_factor)
    k = weight.shape[-1]
    if quantization in NVFP4_FORMATS:
        if weights_scaling_factor2 is None:
            raise ValueError(
                "to_quantized_weight: nvfp4 needs weights_scaling_factor2 (the global scale, "
                "get_weight_scaling_factor_2)"
            )
        assert weights_scaling_factor is not None  # checked above (only mxfp4 may go without)
        block = _group_size(k, weights_scaling_factor, block_size, "to_quantized_weight")
        global_scale = _per_expert(weights_scaling_factor2.to(weight.device), weight, "to_quantized_weight")
        return _fp4_codes(weight, weights_scaling_factor.float() * global_scale, block)
    # mxfp4
    if weights_scaling_factor is None:
        return codecs.mxfp4_quantize(weight, block_size or 32)[0]
    block = _group_size(k, weights_scaling_factor, block_size, "to_quantized_weight")
    return _fp4_codes(weight, codecs.e8m0_decode(weights_scaling_factor), block)


def from_quantized_weight(
    weight: torch.Tensor,
    weights_scaling_factor: Optional[torch.Tensor],
    quantization: Optional[str],
    torch_dtype: torch.dtype,
    *,
    weights_scaling_factor2: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """Converts the quantized weight to the target torch_dtype format (dequantizes, in fp32, then
    casts). A weight of 2+ bytes per element, no scaling factor or no ``quantization`` is taken as
    not quantized and only cast. FP8 stored as int8/uint8 bytes (safetensors without fp8) is read
    as fp8. Beyond the seed's parameters: NVFP4 needs ``weights_scaling_factor2`` (its global
    scale), block FP8 ``block_size``."""
    if not quantization or weights_scaling_factor is None or weight.element_size() >= 2:
        return weight.to(torch_dtype)
    check_format(quantization, "from_quantized_weight")
    scale = weights_scaling_factor.to(weight.device)
    if quantization in (QUANTIZATION_FP8, QUANTIZATION_FP8_PB_WO):
        w8 = weight.view(torch.float8_e4m3fn) if weight.dtype in (torch.int8, torch.uint8) else weight
        if quantization == QUANTIZATION_FP8:
            return (w8.float() * _per_expert(scale, w8, "from_quantized_weight")).to(torch_dtype)
        if not block_size:
            raise ValueError("from_quantized_weight: fp8_pb_wo needs block_size (the square block edge)")
        return codecs.fp8_block_dequantize(w8, scale, (block_size, block_size)).to(torch_dtype)
    if quantization in INT8_FORMATS:
        return (weight.float() * scale.float().unsqueeze(-1)).to(torch_dtype)
    if quantization in INT4_FORMATS:
        codes = unpack_int4_from_uint8(weight)
        _group_size(codes.shape[-1], scale, block_size, "from_quantized_weight")
        return (codes.float() * _expand_groups(scale, codes.shape[-1])).to(torch_dtype)
    k = weight.shape[-1] * 2
    block = _group_size(k, scale, block_size, "from_quantized_weight")
    if quantization in NVFP4_FORMATS:
        if weights_scaling_factor2 is None:
            raise ValueError("from_quantized_weight: nvfp4 needs weights_scaling_factor2 (the global scale)")
        global_scale = weights_scaling_factor2.to(weight.device).float()
        if global_scale.numel() == 1:
            return codecs.nvfp4_dequantize(weight, scale, global_scale, block).to(torch_dtype)
        per_expert = [
            codecs.nvfp4_dequantize(weight[e], scale[e], global_scale.reshape(-1)[e], block)
            for e in range(weight.shape[0])
        ]
        return torch.stack(per_expert).to(torch_dtype)
    return codecs.mxfp4_dequantize(weight, scale, block).to(torch_dtype)


def maybe_transpose_expert_weight_dimensions(
    weight: torch.Tensor, weight_scale: Optional[torch.Tensor] = None, is_bmm_expert_weight: bool = True
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Transpose the last two dimensions of expert weights.

    Stacked (bmm-style) expert weights are stored (num_experts, input_dim, output_dim) in some models
    (llama4, gpt-oss; transformers 5's ``experts.gate_up_proj``), while block quantization wants the
    input dim last: (num_experts, output_dim, input_dim). ``transpose(-2, -1)`` is self-inverse, so
    this converts both ways. Only 3-D weights with ``is_bmm_expert_weight`` are transposed (anything
    else is returned as is); ``weight_scale`` is transposed alongside when it is 3-D too (per-block
    scales), and left alone when it is per tensor / per expert. The results are views.
    """
    if not is_bmm_expert_weight or weight.dim() != 3:
        return weight, weight_scale
    if weight_scale is not None and weight_scale.dim() == 3:
        weight_scale = weight_scale.transpose(-2, -1)
    return weight.transpose(-2, -1), weight_scale
