"""The export input contract: ``(input_ids, position_ids) -> logits``.

Every exported graph takes exactly these two int64 tensors of shape ``[batch, seq]`` and returns
fp logits ``[batch, seq, vocab]``. Keeping the contract this narrow is what lets one graph serve
prefill, decode and mixed batches once the cache stage adds its own inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


class CausalLMLogits(torch.nn.Module):
    """Wraps an HF causal LM behind the contract; no KV cache, no attention mask."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.logits


@dataclass(frozen=True)
class ProbeBatch:
    """A fixed, seeded batch used to compare every snapshot with the eager model."""

    input_ids: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s] int64

    @property
    def args(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return (self.input_ids, self.position_ids)


def make_batch(vocab_size: int, batch: int, seq: int, seed: int = 0, device="cpu") -> ProbeBatch:
    """Seeded random token ids with positions ``0..seq-1`` for each row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return ProbeBatch(ids.to(device), pos.to(device))
