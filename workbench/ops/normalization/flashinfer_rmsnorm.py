"""``workbench::flashinfer_rmsnorm``: ``torch_rmsnorm`` on FlashInfer's fused RMSNorm kernel.

GPU only and an optional extra (``pip install flashinfer-python``). The op is always registered,
so graphs that use it stay loadable and printable everywhere; ``is_available()`` says whether it can
run here and, if not, what is missing. ``fuse_rmsnorm(backend="flashinfer")`` refuses to pick it
when it cannot run, naming the missing piece.

Contract: input [..., H] in float16 or bfloat16, weight [H] of the *same dtype* -> [..., H].
FlashInfer takes 2-D rows, so leading dims are flattened. float32 is refused: flashinfer-python
0.6.18's CUDA norm kernel is built for half precision only (its CuTe DSL path lists fp32, but that
path needs the nvidia-cutlass-dsl libraries, which a GPU machine without network may not have), so
``fuse_rmsnorm`` leaves fp32 norms canonical and the op refuses them, naming the backends that run. One difference from the canonical op in half precision:
FlashInfer multiplies the weight in fp32 and rounds once, where HF rounds the normalised row to
the input dtype first and then rounds the product again (<= 1 ulp apart). In fp32 both agree.
``fuse_rmsnorm`` only swaps nodes whose input and weight dtypes are equal.
"""

from __future__ import annotations

import torch

from ..flashinfer_support import FLASHINFER_DTYPES
from ..flashinfer_support import flashinfer_available as is_available  # noqa: F401  (public per-op name)
from ..library import workbench_op


@workbench_op("flashinfer_rmsnorm", category="norm", norm="rms")
def flashinfer_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """FlashInfer RMSNorm; see the module docstring. What the inputs are is checked first (on any
    machine), then whether FlashInfer runs here."""
    if input.dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"flashinfer_rmsnorm takes float16 or bfloat16, got {input.dtype}: use the 'triton' or "
            "'torch' RMSNorm backend (fuse_rmsnorm.backend=...) for this model"
        )
    if weight.dtype != input.dtype:
        raise ValueError(f"flashinfer_rmsnorm needs weight dtype == input dtype, got {weight.dtype} and {input.dtype}")
    ok, why = is_available(input.device)
    if not ok:
        raise RuntimeError(
            f"flashinfer_rmsnorm cannot run: {why}. Use the 'torch' or 'triton' "
            "RMSNorm backend (fuse_rmsnorm.backend=...)."
        )
    import flashinfer

    rows = input.reshape(-1, input.shape[-1]).contiguous()
    return flashinfer.norm.rmsnorm(rows, weight.contiguous(), eps).reshape(input.shape)


@flashinfer_rmsnorm.register_fake
def _flashinfer_rmsnorm_fake(input, weight, eps):
    return input.new_empty(input.shape, dtype=torch.promote_types(input.dtype, weight.dtype))
