"""Stateful canonical ops: which uncached op becomes which cached op, and what state it keeps.

Attention keeps its past in pages (``torch_cached_attention``); recurrent mechanisms -- a short
causal conv, a Mamba-2 SSM scan, the (gated) delta rule -- keep a fixed-size *state per sequence*,
whatever its length. Every such op pair follows one convention, so one graph rewrite
(``workbench.pipeline.transforms.caches.state_rewrite``) serves all of them::

    torch_X(<positional args>, *, <keyword-only options>) -> Tensor [b, s, ...]
    torch_cached_X(<the same positional args; per-token ones flattened [b, s, ...] -> [1, b*s, ...]>,
                   Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill,
                   Tensor(a!) state_1, ..., *, <the same keyword-only options>) -> Tensor [1, T, ...]

State tensors are ``[num_slots, *state_shape]``; sequence i reads and writes row ``slot_idx[i]``,
starting from zero when ``input_pos[i] == 0`` (so a reused slot never leaks its previous owner's
state). A ``StatefulOp`` entry declares, next to the op, what the rewrite needs: the source and
cached op names (one cached op per backend), which positional args are per-token, the state
tensors and their per-sequence shapes (computed from the uncached node's fake arguments), and the
``insert_cached_*`` transform key that owns it.

Entries are registered when their op module is imported (like ``define_op`` registers the op
itself), once each; ``stateful_ops()`` is the read-only view the pipeline uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

# the metadata a cached stateful op takes after its positional args, in this order
STATE_METADATA_ARGS = ("seq_lens", "input_pos", "slot_idx", "num_prefill")
# Why the cached state ops stay out of CUDA graphs (``workbench.ops.capture``): the torch references
# loop over seq_lens on the host; the Triton ops read nothing on the host in decode-only steps, but
# their capture has not been run on a GPU yet, so they are kept out until it has.
STATE_HOST_SYNC = "reads seq_lens on the host (.tolist()) to walk each sequence"
TRITON_STATE_HOST_SYNC = (
    "prefill steps read seq_lens on the host; capture of its decode-only steps has not been verified on a GPU"
)


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence state tensor of a cached op. ``shape(args)`` gets the uncached node's named
    arguments (fake tensors / values) and returns the per-sequence shape, e.g. ``(channels, k - 1)``."""

    name: str  # graph inputs are named f"{name}_{layer}"
    shape: Callable[[Mapping[str, Any]], Tuple[int, ...]]
    dtype: Optional[torch.dtype] = None  # None: the cache dtype (the model's)


@dataclass(frozen=True)
class StatefulOp:
    source: str  # qualified uncached op, "workbench::torch_causal_conv1d"
    cached: Mapping[str, str]  # backend name -> qualified cached op; "torch" (the CPU reference) required
    token_args: Tuple[str, ...]  # positional args that are per-token [b, s, ...]
    states: Tuple[StateSpec, ...]
    insert_key: str  # the cache_init transform that rewrites it, e.g. "insert_cached_causal_conv"
    description: str = ""  # what the state holds, for tables and renders
    backend_requirements: Mapping[str, str] = field(default_factory=dict)  # backend -> what it needs

    def __post_init__(self):
        if "torch" not in self.cached:
            raise ValueError(f"stateful op {self.source}: the 'torch' cached op (the reference) is required")
        if not self.states:
            raise ValueError(f"stateful op {self.source}: no state tensors declared")

    @staticmethod
    def _overload(qualified: str):
        ns, name = qualified.split("::")
        return getattr(getattr(torch.ops, ns), name).default

    @property
    def source_op(self):
        return self._overload(self.source)

    def cached_op(self, backend: str):
        if backend not in self.cached:
            raise ValueError(f"{self.source} has no cached op for backend {backend!r}; known: {sorted(self.cached)}")
        return self._overload(self.cached[backend])


def check_step_metadata(
    num_tokens: int,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    tokens_of: str,
) -> List[int]:
    """Validate one step's metadata against the ``num_tokens`` flattened tokens of arg ``tokens_of``:
    lengths summing to it, decode rows (after ``num_prefill``) of one token, one input_pos and one slot
    per sequence. Returns ``seq_lens`` as a host list (every stateful reference loops over it)."""
    lens = seq_lens.tolist()
    if sum(lens) != num_tokens:
        raise ValueError(f"seq_lens sum to {sum(lens)} tokens but {tokens_of} has {num_tokens}")
    if not 0 <= num_prefill <= len(lens) or any(n != 1 for n in lens[num_prefill:]):
        raise ValueError(f"num_prefill={num_prefill}: sequences after it must be decode steps (1 token), got {lens}")
    if input_pos.numel() != len(lens) or slot_idx.numel() != len(lens):
        raise ValueError(
            f"metadata sizes disagree: seq_lens {len(lens)}, input_pos {input_pos.numel()}, slot_idx {slot_idx.numel()}"
        )
    return lens


def check_state_shape(state: torch.Tensor, expected: Tuple[int, ...], what: str) -> None:
    """``state`` must be ``[num_slots, *expected]``; ``what`` names it and its layout for the error,
    e.g. ``"ssm_state must be [num_slots, heads, head_dim, state]"``."""
    if state.dim() != len(expected) + 1 or tuple(state.shape[1:]) != tuple(expected):
        raise ValueError(f"{what} = [*, {', '.join(map(str, expected))}]; got {tuple(state.shape)}")


def check_decode_only_metadata(num_tokens: int, slot_idx: torch.Tensor, input_pos: torch.Tensor) -> None:
    """A decode-only step (``num_prefill == 0``) has one token per sequence: checked from sizes
    alone, without reading ``seq_lens`` on the host, so the step stays capturable in a CUDA graph."""
    if slot_idx.numel() != num_tokens or input_pos.numel() != num_tokens:
        raise ValueError(
            f"a decode-only step has one token per sequence: {num_tokens} tokens, slot_idx "
            f"{slot_idx.numel()}, input_pos {input_pos.numel()}"
        )


def initial_states(
    state: torch.Tensor, slots: torch.Tensor, input_pos: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """``[n, *state_shape]``: each sequence's slot row, or zeros for a new sequence (``input_pos == 0``),
    in ``dtype`` (default: the state's). ``where`` rather than a multiply: a reused slot may hold inf/NaN,
    and 0 * NaN is NaN."""
    held = state.index_select(0, slots)
    if dtype is not None:
        held = held.to(dtype)
    fresh = (input_pos <= 0).view(-1, *([1] * (held.dim() - 1)))
    return torch.where(fresh, torch.zeros((), dtype=held.dtype, device=held.device), held)


_STATEFUL: Dict[str, StatefulOp] = {}


def register_stateful_op(op: StatefulOp) -> StatefulOp:
    """Declare ``op`` (called once, where the op is defined); a second entry for one source is an error."""
    if op.source in _STATEFUL:
        raise ValueError(f"stateful op {op.source} registered twice")
    _STATEFUL[op.source] = op
    return op


def stateful_ops() -> Mapping[str, StatefulOp]:
    """Every declared stateful op by source name (importing ``workbench.ops`` declares them all)."""
    return MappingProxyType(_STATEFUL)


def stateful_op_for(target: Any) -> Optional[StatefulOp]:
    """The entry whose uncached op is ``target`` (an OpOverload), or None."""
    schema = getattr(target, "_schema", None)
    return None if schema is None else _STATEFUL.get(schema.name)  # "workbench::torch_x"


__all__ = [
    "STATE_METADATA_ARGS",
    "check_step_metadata",
    "check_state_shape",
    "check_decode_only_metadata",
    "initial_states",
    "StateSpec",
    "StatefulOp",
    "register_stateful_op",
    "stateful_ops",
    "stateful_op_for",
]
