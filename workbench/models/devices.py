"""``resolve_device``: a device string checked against this machine before any work is spent.

``"auto"`` (the default of ``Workbench``, ``load_model`` and ``workbench run``) is the first CUDA
GPU when torch sees one, else the CPU: on a GPU machine the pipeline, its caches and CUDA graphs
land on the GPU without a flag; ``"cpu"`` and ``"cuda"`` still ask for one explicitly."""

from __future__ import annotations

import torch

from ..errors import InputError

AUTO = "auto"


def auto_device(min_gpus: int = 1) -> torch.device:
    """What ``device="auto"`` means here: ``cuda`` when torch sees at least ``min_gpus`` GPUs, else ``cpu``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= min_gpus:
        return torch.device("cuda")
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's weights are on (its first parameter or buffer; CPU if it has none)."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)`` (``"auto"``: ``auto_device()``), refused with a clear message when
    this machine cannot run it.

    Without this, ``device="cuda"`` on a CPU-only torch fails deep in a weight copy with
    "Torch not compiled with CUDA enabled" after the model was half built.
    """
    if isinstance(device, str) and device.strip().lower() == AUTO:
        return auto_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device {device!r} is not a torch device ({e}); use 'auto', 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible to it"
            )
            raise InputError(
                f"device {str(dev)!r} was asked for, but torch {torch.__version__} cannot use CUDA "
                f"here ({why}): use device='cpu' on this machine"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


__all__ = ["AUTO", "auto_device", "model_device", "resolve_device"]
