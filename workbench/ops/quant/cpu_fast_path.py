"""The exact C++ kernel behind a reference quantized linear, where one runs.

``torch_int4_linear`` / ``torch_int8_linear`` are defined by their plain-torch references
(``int4_linear_reference``: dequantize, then ``F.linear``). Run as written, the reference
rebuilds the fp32 weight on every call: a SmolLM2 forward in Q4_1 dequantizes 92 MiB of packed
weights into ~500 MB of fp32 temporaries, which made the numerics probes of a pipeline (one
forward per transform) cost more than the transforms. Where the workbench's CPU kernels are built
(``workbench.ops.cpu_kernels``) the op runs ``cpu_int4_linear`` / ``cpu_int8_linear`` instead:
the same weights, decoded in registers (<= 16 rows of input) or into 256-row fp32 tiles for BLAS
(more rows), so the result equals the reference up to fp32 summation order
(``tests/test_cpu_kernels.py`` checks each kernel against the reference functions, not the op).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def exact_cpu_kernel(name: str, input: torch.Tensor, *fp16_args: torch.Tensor) -> Optional[Callable]:
    """``torch.ops.workbench.<name>`` when it serves this call exactly (CPU, fp32 activations, the
    scale tensors ``fp16_args`` in fp16 as the kernels read them, kernels built), else None."""
    if input.device.type != "cpu" or input.dtype != torch.float32:
        return None
    if any(t.dtype != torch.float16 or t.device.type != "cpu" for t in fp16_args):
        return None
    from .. import cpu_kernels

    if cpu_kernels.load() is not None:
        return None
    return getattr(torch.ops.workbench, name).default
