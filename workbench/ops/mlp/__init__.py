"""Dense MLP and linear ops; see README.md for the table."""

from .cpu_linear_wxt import cpu_linear_wxt  # noqa: F401
from .torch_linear_simple import torch_linear_simple  # noqa: F401
from .torch_silu_mul import torch_silu_and_mul  # noqa: F401
from .torch_swiglu import torch_swiglu_mlp  # noqa: F401
from .triton_silu_mul import triton_silu_and_mul  # noqa: F401
