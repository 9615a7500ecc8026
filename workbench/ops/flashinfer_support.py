"""Where FlashInfer kernels can run, and which attention shapes they take: one answer for every
FlashInfer backend op (RMSNorm, paged cached attention).

FlashInfer is an optional extra (``pip install flashinfer-python``; ``make wheelhouse`` carries it
to a GPU machine without network). Its kernels are CUDA-only and JIT-compiled on first use with
the machine's nvcc (measured on an H100: first ``rmsnorm`` call 33 s, first decode 8.6 s); set
``FLASHINFER_WORKSPACE_BASE`` to keep the builds between runs.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

# Head dims FlashInfer's paged append / prefill / decode kernels are built for (its dispatch
# tables); anything else fails deep inside the library (a tiny config with head_dim 16 did, on an
# H100), so the backend refuses it before touching the graph.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available(device: torch.device | str | None = None) -> Tuple[bool, str]:
    """(True, reason) when FlashInfer can run here (on ``device`` if given), else (False, what is
    missing)."""
    missing = []
    if importlib.util.find_spec("flashinfer") is None:
        missing.append(
            "the flashinfer package is not installed (optional package missing: flashinfer-python; "
            "pip install flashinfer-python, or make wheelhouse for a machine without network)"
        )
    if device is not None and torch.device(device).type != "cuda":
        missing.append(f"the pipeline device is {torch.device(device).type}; FlashInfer kernels need CUDA tensors")
    elif not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (FlashInfer kernels are GPU-only)")
    return (not missing), ("; ".join(missing) or "flashinfer on CUDA")


def flashinfer_attention_unsupported(
    head_dim: int, v_head_dim: int, dtype: torch.dtype, has_sinks: bool = False
) -> Optional[str]:
    """Why FlashInfer's paged attention cannot take this layer's shape, or None when it can."""
    if head_dim != v_head_dim:
        return f"K head_dim {head_dim} != V head_dim {v_head_dim} (FlashInfer's paged kernels need them equal)"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {head_dim} is not one FlashInfer builds kernels for ({', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {str(dtype).replace('torch.', '')} (FlashInfer attention takes float16 or bfloat16)"
    if has_sinks:
        return "attention sinks (not supported by this backend)"
    return None


__all__ = ["flashinfer_available", "flashinfer_attention_unsupported", "FLASHINFER_HEAD_DIMS", "FLASHINFER_DTYPES"]
