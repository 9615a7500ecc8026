"""Stateful canonical ops: which uncached op becomes which cached op, and what state it keeps.

Attention keeps its past in pages (``torch_cached_attention``); recurrent mechanisms -- a short
causal conv, a Mamba-2 SSM scan, the (gated) delta rule -- keep a fixed-size *state per sequence*,
whatever its length. Every such op pair follows one convention, so one graph rewrite
(``workbench.pipeline.state_cache``) serves all of them::

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
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

# the metadata a cached stateful op takes after its positional args, in this order
STATE_METADATA_ARGS = ("seq_lens", "input_pos", "slot_idx", "num_prefill")


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


__all__ = ["STATE_METADATA_ARGS", "StateSpec", "StatefulOp", "register_stateful_op", "stateful_ops", "stateful_op_for"]
