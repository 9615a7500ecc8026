"""Where Triton kernels can run: one answer for every Triton backend op.

On CUDA they compile; on CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``, read
by ``triton.jit`` when a kernel is defined, so it must be set before the kernels are imported).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable, Tuple

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreter_numpy_clash() -> str:
    """Why the installed triton's interpreter cannot run with the installed numpy ('' if it can).

    Triton 3.6's interpreter keeps scalars as 1-element arrays and turns loop bounds into ints with
    ``int(array)``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); triton 3.9's does not. Seen with the GPU image's triton 3.6 on CPU (compiled kernels
    on a GPU never take this path).
    """
    import numpy
    import triton
    from packaging.version import Version

    if Version(triton.__version__).release < (3, 7) and Version(numpy.__version__).release >= (2, 4):
        return (
            f"triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} "
            "(it needs numpy < 2.4, or triton >= 3.7)"
        )
    return ""


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (what the kernels index with stride 1), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def require_triton(device: torch.device, op_name: str, use_torch_instead: str) -> None:
    """Raise where a Triton op cannot run on ``device``, naming how to select the torch backend
    (``use_torch_instead``, e.g. ``"insert_cached_ssm_attention.backend=torch"``): an op called
    where its kernel cannot run fails loudly instead of silently falling back."""
    ok, why = triton_available(device)
    if not ok:
        raise RuntimeError(
            f"{op_name} cannot run on {device}: {why}. Use the 'torch' backend ({use_torch_instead}) on this device."
        )


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
        clash = interpreter_numpy_clash()
        if clash:
            return False, clash
        return True, "triton interpreter (TRITON_INTERPRET=1) on CPU tensors"
    return False, (
        f"triton does not compile for {device.type} tensors (on CPU it runs only under "
        "the interpreter: set TRITON_INTERPRET=1 before triton is imported)"
    )


def lazy_kernel(build: Callable[[], Any]) -> Callable[[], Any]:
    """``build`` run once, on the first call: a Triton kernel is jitted when first launched, so
    importing an op module never needs triton (and ``TRITON_INTERPRET`` is read then)."""
    return functools.lru_cache(maxsize=None)(build)


def num_warps(t: torch.Tensor) -> int:
    """Warps per program: 4 on a GPU; 1 under the CPU interpreter (each warp is simulated)."""
    return 4 if t.device.type == "cuda" else 1
