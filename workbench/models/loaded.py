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


@dataclass
class LoadedModel:
    """A loaded causal LM. ``model`` is in eval() mode with ``requires_grad=False``.

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

    @property
    def num_parameters(self) -> int:
        """Unique parameters (a tied embedding/lm_head pair counts once), weights kept quantized
        included: a quantized matrix counts its logical elements (``num_weights``), once per table."""
        quantized = {id(m.qweight): m.num_weights for m in self.model.modules() if hasattr(m, "num_weights")}
        return sum(p.numel() for p in self.model.parameters()) + sum(quantized.values())

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
        return (f"LoadedModel(spec={self.spec!r}, arch={type(self.model).__name__}, "
                f"params={self.num_parameters / 1e6:.2f}M, {where}, "
                f"tokenizer={'yes' if self.tokenizer is not None else 'no'}, source={self.source!r})")
