"""The quantization format names (ModelOpt's strings) and ``get_quantization_format``.

Per-layer weight formats this package supports (``None`` means unquantized):

======================  ==============================================================================
``"fp8"``               FP8 e4m3 weights and activations, one per-tensor scale each (amax / 448)
``"fp8_pb_wo"``         FP8 e4m3 weights in 2-D blocks (block x block, default 128), weight only
``"int8_sq"``           INT8 weights per output channel + INT8 per-tensor activations (SmoothQuant)
``"int8_wo"``           INT8 weights per output channel, weight only
``"int4_awq"``          signed INT4 weights in groups of the input dimension (AWQ), weight only
                        (W4A16); activations may carry an AWQ ``pre_quant_scale``
``"w4a8_awq"``          INT4 groups followed by a per-tensor FP8 weight quantizer (a
                        ``SequentialQuantizer``), FP8 activations
``"nvfp4"``             FP4 e2m1 values, fp8 scale per 16 values, fp32 global scale (weights and
                        activations)
``"nvfp4_awq"``         ``"nvfp4"`` whose input carries (or had fused into a norm) a pre_quant_scale
``"mxfp4"``             OCP MXFP4: e2m1 values with a power-of-two (e8m0) scale per 32, weight only
======================  ==============================================================================

KV-cache formats (``get_kv_cache_dtype``): ``"FP8"``, ``"INT8"``, ``"NVFP4"``, ``"NVFP4_AFFINE"``.

Not supported (a ``ValueError`` names them): per-channel FP8 (``fp8_pc_pt``), the W4A8 FP4 variants
(``w4a8_nvfp4_fp8``, ``w4a8_mxfp4_fp8``) and real-quantized (compressed) modules.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch.nn as nn

from .quantizer import SequentialQuantizer, TensorQuantizer

QUANTIZATION_NONE = None
QUANTIZATION_FP8 = "fp8"
QUANTIZATION_FP8_PB_WO = "fp8_pb_wo"
QUANTIZATION_INT8_SQ = "int8_sq"
QUANTIZATION_INT8_WO = "int8_wo"
QUANTIZATION_INT4_AWQ = "int4_awq"
QUANTIZATION_W4A8_AWQ = "w4a8_awq"
QUANTIZATION_NVFP4 = "nvfp4"
QUANTIZATION_NVFP4_AWQ = "nvfp4_awq"
QUANTIZATION_MXFP4 = "mxfp4"

SUPPORTED_FORMATS = (
    QUANTIZATION_FP8,
    QUANTIZATION_FP8_PB_WO,
    QUANTIZATION_INT8_SQ,
    QUANTIZATION_INT8_WO,
    QUANTIZATION_INT4_AWQ,
    QUANTIZATION_W4A8_AWQ,
    QUANTIZATION_NVFP4,
    QUANTIZATION_NVFP4_AWQ,
    QUANTIZATION_MXFP4,
)

KV_CACHE_FP8 = "FP8"
KV_CACHE_INT8 = "INT8"
KV_CACHE_NVFP4 = "NVFP4"
KV_CACHE_NVFP4_AFFINE = "NVFP4_AFFINE"
KV_CACHE_FORMATS = (KV_CACHE_FP8, KV_CACHE_INT8, KV_CACHE_NVFP4, KV_CACHE_NVFP4_AFFINE)

NVFP4_FORMATS = (QUANTIZATION_NVFP4, QUANTIZATION_NVFP4_AWQ)
INT4_FORMATS = (QUANTIZATION_INT4_AWQ, QUANTIZATION_W4A8_AWQ)
INT8_FORMATS = (QUANTIZATION_INT8_SQ, QUANTIZATION_INT8_WO)


def check_format(quantization, what: str) -> str:
    """``quantization`` if it is one of ``SUPPORTED_FORMATS``, else a ``ValueError`` listing them."""
    if quantization not in SUPPORTED_FORMATS:
        raise ValueError(
            f"{what}: unsupported quantization format {quantization!r}; supported: "
            f"{', '.join(SUPPORTED_FORMATS)} (see workbench.quantization.formats)"
        )
    return quantization


def quantizer_names(weight_name: str = "weight") -> Tuple[str, str]:
    """The (weight quantizer, input quantizer) attribute names for a weight attribute: ``weight`` ->
    ``weight_quantizer`` / ``input_quantizer``; a stacked expert weight ``gate_up_proj`` ->
    ``gate_up_proj_weight_quantizer`` / ``gate_up_proj_input_quantizer`` (ModelOpt's naming)."""
    if weight_name == "weight":
        return "weight_quantizer", "input_quantizer"
    return f"{weight_name}_weight_quantizer", f"{weight_name}_input_quantizer"


def weight_names(module: nn.Module) -> Iterator[str]:
    """The weight attributes of ``module`` that have (or could have) a weight quantizer: ``weight``
    if present, and every ``X`` with an ``X_weight_quantizer`` attribute."""
    if hasattr(module, "weight") or hasattr(module, "weight_quantizer"):
        yield "weight"
    for name, _ in module.named_children():
        if name.endswith("_weight_quantizer"):
            yield name[: -len("_weight_quantizer")]


def weight_format(module: nn.Module, weight_name: str = "weight") -> Optional[str]:
    """The format one weight of ``module`` is quantized in, from its quantizers' settings (its children
    are not looked at, unlike ``get_quantization_format``)."""
    w_name, in_name = quantizer_names(weight_name)
    wq = getattr(module, w_name, None)
    iq = getattr(module, in_name, None)
    if wq is None or not wq.is_enabled:
        return QUANTIZATION_NONE
    if isinstance(wq, SequentialQuantizer):
        stages: List[TensorQuantizer] = list(wq)
        if len(stages) == 2 and stages[0].num_bits == 4 and stages[0].block_size > 0 and stages[1].num_bits == (4, 3):
            return QUANTIZATION_W4A8_AWQ
        raise ValueError(
            f"unsupported SequentialQuantizer {[q.num_bits for q in stages]}: only "
            "[int4 in groups, fp8 per tensor] (w4a8_awq) is supported"
        )
    if not isinstance(wq, TensorQuantizer):
        raise TypeError(f"{w_name} is a {type(wq).__name__}, expected a TensorQuantizer")
    input_enabled = iq is not None and iq.is_enabled
    if wq.num_bits == 4:
        if wq.block_size <= 0:
            raise ValueError(
                "unsupported int4 weight quantizer without block_sizes: int4 is supported "
                "in groups only (int4_awq); set block_sizes={-1: group_size}"
            )
        return QUANTIZATION_INT4_AWQ
    if wq.num_bits == 8:
        return QUANTIZATION_INT8_SQ if input_enabled else QUANTIZATION_INT8_WO
    if wq.num_bits == (4, 3):
        if wq.block_sizes:
            return QUANTIZATION_FP8_PB_WO
        if wq.axis is not None:
            raise ValueError(
                "unsupported per-channel FP8 weight quantizer (fp8_pc_pt); use axis=None "
                "(fp8, per tensor) or block_sizes (fp8_pb_wo)"
            )
        return QUANTIZATION_FP8
    if wq.num_bits == (2, 1):
        if wq.scale_bits == (4, 3):
            has_pqs = iq is not None and iq.pre_quant_scale is not None
            if has_pqs or getattr(module, "fused_with_layernorm", False):
                return QUANTIZATION_NVFP4_AWQ
            return QUANTIZATION_NVFP4
        if wq.scale_bits == (8, 0):
            return QUANTIZATION_MXFP4
        raise ValueError(f"unsupported FP4 scale_bits {wq.scale_bits!r}: (4, 3) is NVFP4, (8, 0) is MXFP4")
    raise ValueError(
        f"unsupported weight quantizer num_bits={wq.num_bits!r}: supported are 4 (int4 "
        "groups), 8 (int8), (4, 3) (fp8) and (2, 1) (fp4)"
    )


def get_quantization_format(module: nn.Module) -> Optional[str]:
    """Gets the quantization string.

    Gets the quantization string by iterating through the module and its children. The first
    non-None quantization string is returned: the module's own weights first (``weight``, then
    stacked expert weights with ``X_weight_quantizer``), then its children depth first. A module
    with no enabled weight quantizer anywhere gives ``None``.
    """
    for name in weight_names(module):
        fmt = weight_format(module, name)
        if fmt is not QUANTIZATION_NONE:
            return fmt
    for _, child in module.named_children():
        if isinstance(child, (TensorQuantizer, SequentialQuantizer)):
            continue
        fmt = get_quantization_format(child)
        if fmt is not QUANTIZATION_NONE:
            return fmt
    return QUANTIZATION_NONE
