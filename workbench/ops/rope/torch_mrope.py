"""Multimodal RoPE (mRoPE, Qwen2-VL / Qwen2.5-VL): the cos/sin table from 3-section positions, and
the per-sequence position offset (``rope_deltas``) a cached graph adds to it.

mRoPE keeps the ordinary rotate-half rotation of q and k; only the *table* changes. Every token has
three positions -- temporal, height, width -- and the ``d/2`` rotary frequencies are split into
three consecutive sections (``mrope_section``, summing to ``d/2``): frequencies of section ``i``
rotate by position row ``i % 3``. Text tokens have three equal positions, so for a text-only model
the table is exactly the plain RoPE table.

Two ops, kept apart on purpose:

* ``torch_mrope_cos_sin(position_ids, inv_freq, mrope_section, attention_scaling) -> (cos, sin)``
  builds the table ``[b, s, d]`` once per forward (HF computes it once in the text model and shares
  it between layers). The rotation stays ``torch_rope_with_explicit_cos_sin``, which the rope
  matcher already finds in the attention and ``fuse_rope`` already hands to its backends.
* ``torch_mrope_delta_positions(position_ids, mrope_delta_cache, seq_lens, slot_idx)`` adds each
  token's sequence delta (``mrope_delta_cache[slot_idx[seq]]``) to the positions of a flattened
  mixed batch: what ``initialize_mrope_delta_cache`` puts in front of the table op. For a vision
  prompt, the delta is what makes the text tokens after the image continue from the image's
  largest position instead of from the token count (HF's ``rope_deltas``); text-only it is 0.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..library import define_op


def _positions3(position_ids: torch.Tensor) -> torch.Tensor:
    """``[3, b, s]`` positions: [b, s] (text: the same position in every section) is broadcast."""
    if position_ids.dim() == 2:
        return position_ids.expand(3, *position_ids.shape)
    if position_ids.dim() == 3 and position_ids.shape[0] == 3:
        return position_ids
    raise ValueError(
        f"mRoPE positions must be [b, s] or [3, b, s] (temporal, height, width), got {tuple(position_ids.shape)}"
    )


def _check_sections(mrope_section: Sequence[int], half: int) -> List[int]:
    sections = [int(n) for n in mrope_section]
    if sum(sections) != half or any(n < 0 for n in sections):
        raise ValueError(
            f"mrope_section {sections} must be non-negative and sum to head_dim/2 = {half} "
            "(the number of rotary frequencies, inv_freq.numel()); check rope_parameters['mrope_section']"
        )
    return sections


def mrope_cos_sin_reference(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int], attention_scaling: float = 1.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[b, s, d]`` fp32, ``d = 2 * inv_freq.numel()``, rotate-half layout (both halves equal).

    position_ids [b, s] or [3, b, s] (int); inv_freq [d/2]; frequency j of section i (consecutive
    runs of ``mrope_section``) is rotated by position row ``i % 3``. Angles are ``pos.float() *
    inv_freq`` in fp32, as HF computes them; selecting a section before ``cos``/``sin`` instead of
    after changes no value (every element is the same rounded product), and halves the work.
    """
    pos = _positions3(position_ids)
    sections = _check_sections(mrope_section, inv_freq.numel())
    freq = inv_freq.to(torch.float32)
    parts, start = [], 0
    for i, n in enumerate(sections):
        parts.append(pos[i % 3].unsqueeze(-1).to(torch.float32) * freq[start : start + n])  # [b, s, n]
        start += n
    angles = torch.cat(parts, dim=-1)  # [b, s, d/2]
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _cos_sin_fake(position_ids, inv_freq, mrope_section, attention_scaling=1.0):
    pos = _positions3(position_ids)
    shape = (pos.shape[1], pos.shape[2], 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(shape, dtype=torch.float32))


# The canonical mRoPE table, traced by export through ``models/canonical/mrope.py``.
torch_mrope_cos_sin = define_op(
    "torch_mrope_cos_sin(Tensor position_ids, Tensor inv_freq, int[] mrope_section, float attention_scaling=1.0) "
    "-> (Tensor, Tensor)",
    mrope_cos_sin_reference,
    _cos_sin_fake,
    category="elementwise",
)


def token_sequence(seq_lens: torch.Tensor, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [T] int64, valid [T] bool) of each flattened token (``seq_lens [B]``).

    Tokens past ``sum(seq_lens)`` (padding rows a compiled runner may add) get ``valid = False``
    and index ``B - 1``. No host sync (searchsorted over the cumulative ends), so it runs inside a
    captured CUDA graph.
    """
    ends = torch.cumsum(seq_lens.to(torch.int64), 0)  # [B]
    tokens = torch.arange(num_tokens, device=seq_lens.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, tokens, right=True)  # first sequence whose end is past the token
    valid = seq < seq_lens.numel()
    return seq.clamp(max=max(seq_lens.numel() - 1, 0)), valid


def mrope_delta_positions_reference(
    position_ids: torch.Tensor, mrope_delta_cache: torch.Tensor, seq_lens: torch.Tensor, slot_idx: torch.Tensor
) -> torch.Tensor:
    """``position_ids + mrope_delta_cache[slot_idx[seq(t)], 0]`` for every token t.

    position_ids [..., b, s] (e.g. [3, b, s]) whose last two dims flatten to the step's T tokens in
    order (the runtime's [1, T]; the probe's [b, s] of b sequences of s tokens); mrope_delta_cache
    [num_slots, 1] int64; seq_lens / slot_idx [B] int32. Returns a new tensor of position_ids'
    shape and dtype; the delta is the same for the leading (section) dims.
    """
    if mrope_delta_cache.dim() != 2 or mrope_delta_cache.shape[1] != 1:
        raise ValueError(f"mrope_delta_cache must be [num_slots, 1], got {tuple(mrope_delta_cache.shape)}")
    if position_ids.dim() < 2:
        raise ValueError(f"positions must end in [b, s] token dims, got {tuple(position_ids.shape)}")
    if seq_lens.numel() != slot_idx.numel():
        raise ValueError(f"seq_lens ({seq_lens.numel()}) and slot_idx ({slot_idx.numel()}) describe different batches")
    b, s = position_ids.shape[-2:]
    if seq_lens.numel() == 0 or b * s == 0:
        return position_ids.clone()
    seq, valid = token_sequence(seq_lens, b * s)
    delta = mrope_delta_cache[slot_idx.to(torch.int64)[seq], 0]  # [T]
    delta = torch.where(valid, delta, torch.zeros_like(delta))
    return position_ids + delta.view(b, s).to(position_ids.dtype)


def _delta_fake(position_ids, mrope_delta_cache, seq_lens, slot_idx):
    return position_ids.new_empty(position_ids.shape)


torch_mrope_delta_positions = define_op(
    "torch_mrope_delta_positions(Tensor position_ids, Tensor mrope_delta_cache, Tensor seq_lens, Tensor slot_idx) "
    "-> Tensor",
    mrope_delta_positions_reference,
    _delta_fake,
    category="elementwise",
)


__all__ = [
    "torch_mrope_cos_sin",
    "torch_mrope_delta_positions",
    "mrope_cos_sin_reference",
    "mrope_delta_positions_reference",
    "token_sequence",
]
