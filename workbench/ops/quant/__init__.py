"""Weight-only quantized linear ops; see README.md for the table."""

from .int4 import dequantize_int4, pack_int4, torch_int4_linear, unpack_int4  # noqa: F401
from .int8 import dequantize_int8, torch_int8_embedding, torch_int8_linear  # noqa: F401
