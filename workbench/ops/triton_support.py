"""Where Triton kernels can run: one answer for every Triton backend op.

On CUDA they compile; on CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``, read
by ``triton.jit`` when a kernel is defined, so it must be set before the kernels are imported).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str = "cuda") -> Tuple[bool, str]:
    """Whether Triton kernels can run on ``device``, and why not if they cannot."""
    device = torch.device(device)
    if not HAS_TRITON:
        return False, "the 'triton' package is not installed"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, "triton on CUDA"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "triton interpreter (TRITON_INTERPRET=1) on CPU tensors"
    return False, (f"triton does not compile for {device.type} tensors (on CPU it runs only under "
                   "the interpreter: set TRITON_INTERPRET=1 before triton is imported)")
