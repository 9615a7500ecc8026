"""Build a registered custom model beside the HF model it stands in for, sharing every tensor.

``load_model`` keeps the HF model (``LoadedModel.model``: the numerics reference every snapshot is
compared with, the eager model ``generate`` is checked against) and, when ``CUSTOM_MODELS`` has a
class for its config, builds that class as ``LoadedModel.export_model`` -- what ``export_to_gm``
traces. Memory: the custom model is constructed on ``meta`` (no storage), then takes the HF model's
own tensors: its parameters and persistent buffers through a strict
``load_state_dict(hf.state_dict(keep_vars=True), assign=True)`` (the checkpoint's names, unchanged:
a missing or unexpected key is an error), its non-persistent buffers (RoPE ``inv_freq``) by name.
So the pair costs one copy of the weights, ties survive (the same ``Parameter`` objects), and every
tensor the exported graph names is a tensor of the HF model under the same name -- which is what
``load_weights`` binds the graph to (``pipeline.weights.WeightSource`` indexes the HF model).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from . import CUSTOM_MODELS


class CustomModelError(RuntimeError):
    """The registered custom model cannot stand in for this HF model (names the mismatch and the way out)."""


def custom_model_class(config, registry: Mapping[str, type] = CUSTOM_MODELS) -> Optional[type]:
    """The custom model class registered for ``config``'s class (by name), or None."""
    return registry.get(type(config).__name__)


def _set_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[attr] = tensor


@torch.no_grad()
def share_tensors(reference: torch.nn.Module, custom: torch.nn.Module) -> torch.nn.Module:
    """Give ``custom`` (built on meta) the reference's tensors by name; see the module docstring."""
    state = reference.state_dict(keep_vars=True)
    try:
        custom.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CustomModelError(
            f"the HF {type(reference).__name__}'s state dict does not load into custom {type(custom).__name__} "
            f"unchanged: {e}. Load with custom_models=False to export the HF class"
        ) from None
    held = dict(reference.named_buffers(remove_duplicate=False))
    for name, _ in list(custom.named_buffers(remove_duplicate=False)):
        if name in state:
            continue
        if name not in held:
            raise CustomModelError(
                f"custom {type(custom).__name__} has a buffer {name!r} that the HF {type(reference).__name__} does not "
                "hold: the exported graph could not be bound to the HF model's tensors by name"
            )
        _set_tensor(custom, name, held[name])
    left = [n for n, t in [*custom.named_parameters(), *custom.named_buffers()] if t.is_meta]
    if left and not all(t.is_meta for t in reference.parameters()):
        raise CustomModelError(
            f"custom {type(custom).__name__}: tensors without a counterpart in the HF model: {left[:6]}"
        )
    return custom


def build_export_model(
    reference: torch.nn.Module, registry: Mapping[str, type] = CUSTOM_MODELS
) -> Optional[torch.nn.Module]:
    """The custom model registered for ``reference.config``, sharing every tensor with ``reference``
    (eval mode, no grad), or None when no custom model is registered for that config class."""
    cls = custom_model_class(reference.config, registry)
    if cls is None:
        return None
    try:
        with torch.device("meta"):
            custom = cls(reference.config)
    except (NotImplementedError, ValueError) as e:
        raise CustomModelError(f"custom {cls.__name__} cannot be built for this config: {e}") from None
    share_tensors(reference, custom)
    return custom.eval().requires_grad_(False)


__all__ = ["CustomModelError", "custom_model_class", "share_tensors", "build_export_model"]
