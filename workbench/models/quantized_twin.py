"""The dequantized twin with its activations rounded as the checkpoint's format rounds them.

The twin (``quantized_checkpoint``) multiplies by the dequantized weights but keeps its activations
in the model's dtype, so formats that quantize activations too -- FP8 and fine-grained FP8 (W8A8),
NVFP4 (W4A4) -- cannot match it exactly: each linear's input is rounded to the format's grid
first, and on the tiny random models (gain ~2.4 a layer) the logits move by a good part of their
spread (``tests/test_quantized_checkpoints.py``: 0.17-0.24 relative RMSE for FP8, 0.54-0.57 for
NVFP4). ``rounded_activations(loaded)`` puts that rounding into the twin itself, on every quantized
``nn.Linear`` with forward pre-hooks, so HF's own ``generate`` on it is an exact reference for what
the pipeline's quantized ops compute (up to float32 summation order): the pipeline is then checked
token for token, not within a loose bound.

Linears only: MoE experts stacked into one parameter are not covered (a model that has them keeps
its bound). Weight-only formats (AWQ, GPTQ, MXFP4) round no activations: nothing is hooked.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from ..ops.quant.fp8 import fp8_group_qdq, fp8_qdq
from ..ops.quant.nvfp4 import nvfp4_qdq
from .loaded import LoadedModel

ACTIVATION_FORMATS = ("FP8", "FP8_BLOCK", "NVFP4")


def _rounding(loaded: LoadedModel, name: str) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """How the quantized op of linear ``name`` rounds its input (``None``: it does not)."""
    ckpt = loaded.checkpoint
    assert ckpt is not None
    fmt, tensors = ckpt.config.quant_algo, ckpt.tensors
    if fmt == "FP8_BLOCK" and f"{name}.weight_scale_inv" in tensors:
        block_k = (ckpt.config.weight_block_size or (128, 128))[1]
        return lambda x: fp8_group_qdq(x, block_k)
    scale = tensors.get(f"{name}.input_scale")
    if scale is None:
        return None
    if fmt == "FP8":
        return lambda x: fp8_qdq(x, scale.float().reshape(()))
    if fmt == "NVFP4":
        return lambda x: nvfp4_qdq(x, scale.float())
    return None


@contextmanager
def rounded_activations(loaded: LoadedModel) -> Iterator[int]:
    """Within the block, ``loaded.model`` rounds the input of every quantized linear as the
    checkpoint's format does (FP8: per tensor by ``input_scale``; FP8_BLOCK: per token and group of
    ``block_k``; NVFP4: blocks of 16 under the global ``input_scale``). Yields how many linears it
    hooked. The hooks are removed on exit, also after an error."""
    if loaded.checkpoint is None:
        raise ValueError(f"{loaded.spec}: not a quantized checkpoint (loaded.checkpoint is None): nothing to round")
    handles = []
    try:
        for name, module in loaded.model.named_modules():
            rounding = _rounding(loaded, name) if isinstance(module, torch.nn.Linear) else None
            if rounding is not None:

                def pre_hook(_module, args, rounding=rounding):
                    x = args[0]
                    return (rounding(x).to(x.dtype), *args[1:])

                handles.append(module.register_forward_pre_hook(pre_hook))
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


__all__ = ["rounded_activations", "ACTIVATION_FORMATS"]
