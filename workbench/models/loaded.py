"""The value returned by ``load_model``: model + config + tokenizer + provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from .quantized_checkpoint import QuantizedCheckpoint


def _storage_key(t: torch.Tensor):
    # Meta tensors have no storage (data_ptr 0 for all); count each one on its own.
    return ("id", id(t)) if t.is_meta else (t.device, t.untyped_storage().data_ptr())


def describe_model_class(model: torch.nn.Module, custom: bool) -> str:
    """``"custom DeepseekV3ForCausalLM (workbench.models.custom.modeling_deepseek_v3)"``, or an HF class
    the same way without ``custom``: what the export snapshot reports as ``model_class``."""
    return f"{'custom ' if custom else ''}{type(model).__name__} ({type(model).__module__})"


@dataclass
class LoadedModel:
    """A loaded causal LM. ``model`` (and ``export_model``) in eval() mode with ``requires_grad=False``.

    ``repr`` is kept to one line on purpose: the default dataclass repr would print the
    whole module tree and config in a notebook cell.
    """

    spec: str
    model: torch.nn.Module = field(repr=False)
    config: "PretrainedConfig" = field(repr=False)
    tokenizer: Optional["PreTrainedTokenizerBase"] = field(repr=False)
    source: str
    # A quantized checkpoint directory: ``model`` is its dequantized twin, this holds the quant
    # config and the raw quantized tensors (``models.quantized_checkpoint``). None otherwise.
    checkpoint: Optional["QuantizedCheckpoint"] = field(default=None, repr=False)
    # The model ``export_to_gm`` traces in place of ``model``: the custom canonical-op model registered
    # for the config (``models/custom``), built by ``load_model`` sharing every tensor with ``model``.
    # None: ``model`` itself is exported. ``model`` stays the HF class either way: the numerics
    # reference, and what ``generate`` and the tests compare tokens with.
    export_model: Optional[torch.nn.Module] = field(default=None, repr=False)
    # Why the custom model registered for this config was not built (it refused the config) and the
    # HF class is exported instead; None when none is registered or it was built.
    custom_fallback: Optional[str] = None

    @property
    def model_to_export(self) -> torch.nn.Module:
        """``export_model`` when a custom model was built, else the HF ``model``."""
        return self.export_model if self.export_model is not None else self.model

    @property
    def export_model_class(self) -> str:
        """What gets exported, for reports: ``"custom DeepseekV3ForCausalLM (workbench.models.custom...)"``
        or the HF class with its module."""
        return describe_model_class(self.model_to_export, custom=self.export_model is not None)

    @property
    def num_parameters(self) -> int:
        """Unique parameters (a tied embedding/lm_head pair counts once), weights kept quantized
        included: a quantized matrix counts its logical elements (``num_weights``), once per table."""
        quantized = {id(m.qweight): m.num_weights for m in self.model.modules() if hasattr(m, "num_weights")}
        return sum(p.numel() for p in self.model.parameters()) + sum(quantized.values())  # type: ignore[arg-type]  # nn.Module's __getattr__ stub: num_weights is an int

    @property
    def parameter_bytes(self) -> int:
        """Bytes held by parameters + buffers, counting shared storage (tied weights) once."""
        seen: dict = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            key = _storage_key(t)
            size = t.numel() * t.element_size() if t.is_meta else t.untyped_storage().nbytes()
            seen[key] = max(seen.get(key, 0), size)
        return sum(seen.values())

    def __repr__(self) -> str:
        p = next(self.model.parameters(), None)
        where = f"{p.dtype}, {p.device}" if p is not None else "no params"
        custom = f", export=custom {type(self.export_model).__name__}" if self.export_model is not None else ""
        return (
            f"LoadedModel(spec={self.spec!r}, arch={type(self.model).__name__}{custom}, "
            f"params={self.num_parameters / 1e6:.2f}M, {where}, "
            f"tokenizer={'yes' if self.tokenizer is not None else 'no'}, source={self.source!r})"
        )
