"""The explicit context every transform receives, instead of globals.

Re-running a notebook cell builds a new context, so nothing leaks between runs. ``shared`` holds
state that one transform hands to a later one (e.g. the KV-cache manager); the stepper saves it in
each snapshot and restores it on rewind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch


@dataclass
class PipelineContext:
    spec: str
    loaded: Any  # workbench.models.LoadedModel: model, config, tokenizer
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int = 64
    max_seq_len: int = 2048
    shared: Dict[str, Any] = field(default_factory=dict)
    # Cache tensors (KV pages, SSM state...) by name; their bytes are reported in snapshots.
    resources: Dict[str, torch.Tensor] = field(default_factory=dict)
    # The eager model's tensors by graph attribute name (pipeline.weights.WeightSource): what
    # load_weights binds the meta-traced graph to.
    weights: Optional[Mapping[str, torch.Tensor]] = None

    @property
    def config(self) -> Any:
        return self.loaded.config

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.config.vocab_size)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.resources.values())
