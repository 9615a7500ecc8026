"""Quantized ops (weight-only int4/int8, FP8, NVFP4, MXFP4, AWQ/GPTQ, quantized MoE and SwiGLU,
fake-quant) and the format codecs they share; see README.md for the table."""

from . import codecs  # noqa: F401
from .fake_quant import torch_fake_quant_fp8, torch_fake_quant_nvfp4  # noqa: F401
from .fp8 import torch_finegrained_fp8_linear, torch_fp8_bmm, torch_fp8_linear  # noqa: F401
from .int4 import dequantize_int4, pack_int4, torch_int4_linear, unpack_int4  # noqa: F401
from .int4_awq_gptq import torch_int4_awq_linear, torch_int4_gptq_linear  # noqa: F401
from .int8 import dequantize_int8, torch_int8_embedding, torch_int8_linear  # noqa: F401
from .nvfp4 import torch_nvfp4_linear  # noqa: F401
from .quant_moe import torch_finegrained_fp8_moe, torch_fp8_moe, torch_mxfp4_moe, torch_nvfp4_moe  # noqa: F401
from .quant_swiglu import torch_finegrained_fp8_swiglu_mlp, torch_nvfp4_swiglu_mlp  # noqa: F401
