"""``resolve_device``: a device string checked against this machine before any work is spent."""

from __future__ import annotations

import torch

from ..errors import InputError


def resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, refused with a clear message when this machine cannot run it.

    Without this, ``device="cuda"`` on a CPU-only torch fails deep in a weight copy with
    "Torch not compiled with CUDA enabled" after the model was half built.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device {device!r} is not a torch device ({e}); use 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible to it")
            raise InputError(f"device {str(dev)!r} was asked for, but torch {torch.__version__} cannot use CUDA "
                             f"here ({why}): use device='cpu' on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


__all__ = ["resolve_device"]
