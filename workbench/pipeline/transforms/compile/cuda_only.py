"""Config and skip rule of the compile-stage transforms whose rewrite only pays off (or only runs)
on CUDA (``multi_stream_*``, ``fuse_causal_conv_activation``)."""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import Field

from ...context import PipelineContext
from ...interface import TransformConfig


class CudaOnlyConfig(TransformConfig):
    require_cuda: bool = Field(
        default=True,
        description="Skip (reported, with the reason) unless the pipeline device is CUDA. Set false "
        "to apply the rewrite on CPU too, e.g. to inspect it: the stream ops are then pass-throughs.",
    )


def cuda_skip_reason(ctx: PipelineContext, what: str) -> Optional[str]:
    """Why a CUDA-only compile-stage transform cannot apply here, or None when it can."""
    device = torch.device(ctx.device)
    if device.type != "cuda":
        return f"{what} needs a CUDA device; the pipeline device is {device.type}, graph left unchanged"
    if not torch.cuda.is_available():
        return f"{what} needs a CUDA device, and CUDA is not available here; graph left unchanged"
    return None


__all__ = ["CudaOnlyConfig", "cuda_skip_reason"]
