"""The backend table of the ``post_load_fusion`` stage, and the device helpers its transforms share.

Match first, fuse later: the pattern stage leaves canonical ``torch_*`` ops; a fusion transform
swaps them for a backend op picked here by name. Every backend is registered whatever the machine
(so a YAML naming one always validates); whether it can *run* is asked when the transform runs,
through the op module's ``is_available(device) -> (ok, reason)``:

    family     backend      op (torch.ops.workbench.*)            needs
    rmsnorm    torch        torch_rmsnorm (canonical, kept)       nothing
    rmsnorm    triton       triton_rmsnorm                        triton + CUDA (or TRITON_INTERPRET=1)
    rmsnorm    flashinfer   flashinfer_rmsnorm                    flashinfer + CUDA
    rope       torch        torch_rope_with_explicit_cos_sin      nothing
    rope       triton       triton_rope_with_explicit_cos_sin     triton + CUDA (or TRITON_INTERPRET=1)
    silu_mul   torch        torch_silu_and_mul                    nothing
    silu_mul   triton       triton_silu_and_mul                   triton + CUDA (or TRITON_INTERPRET=1)

``auto`` picks Triton on a CUDA device when it is available and the torch op otherwise; it never
picks FlashInfer (its half-precision rounding differs slightly from HF, so it is opt-in). An
explicitly named backend that cannot run is an error that names what is missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from ..interface import TransformConfig


@dataclass(frozen=True)
class OpBackend:
    family: str
    name: str
    module: str  # where the op and its is_available() live (imported on use)
    op_name: str  # torch.ops.workbench.<op_name>
    requirement: str  # what it needs, for error messages

    def availability(self, device: torch.device) -> Tuple[bool, str]:
        mod = importlib.import_module(self.module)
        is_available = getattr(mod, "is_available", None)
        if is_available is None:
            return True, "no requirements"
        return is_available(device)

    @property
    def op(self) -> Callable:
        importlib.import_module(self.module)
        return getattr(torch.ops.workbench, self.op_name).default


_NORM, _ROPE, _MLP = "workbench.ops.normalization", "workbench.ops.rope", "workbench.ops.mlp"
_TRITON_NEEDS = "triton and a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
BACKENDS: Dict[str, Dict[str, OpBackend]] = {}
for _b in (
    OpBackend("rmsnorm", "torch", f"{_NORM}.torch_norms", "torch_rmsnorm", "nothing beyond PyTorch"),
    OpBackend("rmsnorm", "triton", f"{_NORM}.triton_rmsnorm", "triton_rmsnorm", _TRITON_NEEDS),
    OpBackend("rmsnorm", "flashinfer", f"{_NORM}.flashinfer_rmsnorm", "flashinfer_rmsnorm",
              "a CUDA GPU and the flashinfer package (pip install flashinfer-python)"),
    OpBackend("rope", "torch", f"{_ROPE}.torch_rope", "torch_rope_with_explicit_cos_sin",
              "nothing beyond PyTorch"),
    OpBackend("rope", "triton", f"{_ROPE}.triton_rope", "triton_rope_with_explicit_cos_sin",
              _TRITON_NEEDS),
    OpBackend("silu_mul", "torch", f"{_MLP}.torch_silu_mul", "torch_silu_and_mul",
              "nothing beyond PyTorch"),
    OpBackend("silu_mul", "triton", f"{_MLP}.triton_silu_mul", "triton_silu_and_mul", _TRITON_NEEDS),
):
    BACKENDS.setdefault(_b.family, {})[_b.name] = _b
AUTO_PREFERENCE = {"cuda": ("triton", "torch"), "cpu": ("torch",)}


def backend_names(family: str) -> Tuple[str, ...]:
    return ("auto", *BACKENDS[family])


def resolve_backend(family: str, name: str, device: torch.device, key: str) -> Tuple[OpBackend, str]:
    """The backend to use and why; raises ``RuntimeError`` naming what is missing when ``name``
    was asked for explicitly and cannot run on ``device``. ``key`` is the transform (for hints)."""
    table = BACKENDS[family]
    if name == "auto":
        skipped = []
        for candidate in AUTO_PREFERENCE.get(device.type, ("torch",)):
            ok, why = table[candidate].availability(device)
            if ok:
                note = f"auto on {device.type}: {candidate}"
                return table[candidate], note + (f" ({'; '.join(skipped)})" if skipped else "")
            skipped.append(f"{candidate} unavailable: {why}")
        return table["torch"], f"auto on {device.type}: torch ({'; '.join(skipped)})"
    if name not in table:
        raise ValueError(f"unknown {family} backend {name!r}; known: {', '.join(backend_names(family))}")
    backend = table[name]
    ok, why = backend.availability(device)
    if not ok:
        raise RuntimeError(
            f"{family} backend '{name}' cannot run on {device}: {why}. It needs {backend.requirement}; "
            f"pick backend 'torch' ({key}.backend=torch) to run anywhere, or 'auto'."
        )
    return backend, f"{name} (requested)"


# ------------------------------------------------------------------------------ device helpers


def graph_device(gm: fx.GraphModule, ctx: Any) -> torch.device:
    """The pipeline's device (``ctx.device``), else where the graph's parameters live."""
    if ctx is not None and getattr(ctx, "device", None) is not None:
        return torch.device(ctx.device)
    for p in gm.parameters():
        return p.device
    return torch.device("cpu")


class CudaOnlyConfig(TransformConfig):
    """Config of the compile-stage transforms whose rewrite only pays off (or only runs) on CUDA."""

    require_cuda: bool = Field(
        default=True,
        description="Skip (reported, with the reason) unless the pipeline device is CUDA. Set false "
        "to apply the rewrite on CPU too, e.g. to inspect it: the stream ops are then pass-throughs.",
    )


def cuda_skip_reason(gm: fx.GraphModule, ctx: Any, what: str) -> Optional[str]:
    """Why a CUDA-only compile-stage transform cannot apply here, or None when it can."""
    device = graph_device(gm, ctx)
    if device.type != "cuda":
        return f"{what} needs a CUDA device; the pipeline device is {device.type}, graph left unchanged"
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA device, and CUDA is not available here; graph left unchanged"
    return None


__all__ = ["OpBackend", "BACKENDS", "backend_names", "resolve_backend", "graph_device",
           "cuda_skip_reason", "CudaOnlyConfig"]
