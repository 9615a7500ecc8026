"""Per-sequence state caches (stage ``cache_init``): ``insert_cached_ssm_attention``,
``insert_cached_causal_conv``, ``insert_cached_delta_rule``, ``insert_cached_gated_delta_rule``,
``insert_cached_linear_attention``.

Each rewrites the canonical stateful op nodes it owns (``workbench.ops.state``: the op entry names
its insert key) into their cached ops over per-sequence state slots (see ``state_rewrite.py``),
and declares the ``SLOT`` cache specs that ``initialize_cache`` allocates next to the KV pages:
``[num_slots, *state_shape]`` per layer, ``num_slots = max_batch_size + 1``. What a sequence's state
costs does not grow with its length; ``details`` report it per layer and in total.

The keys differ only in which ops they own (and the SSM key's extra seed field), so they
share one base class. A graph with no such node reports 0 matches with the reason.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from pydantic import Field, field_validator
from typing_extensions import TypeVar

from ....ops.backends import state_backends
from ....ops.state import StatefulOp, stateful_ops
from ....runtime.interface import CacheSpec
from ...context import CACHE_SPECS, PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from .state_rewrite import rewrite_stateful_node, stateful_nodes


class InsertCachedStateConfig(TransformConfig):
    backend: Optional[str] = Field(
        default=None,
        description="The cached-op backend: auto | torch | triton (auto or None: triton on a CUDA GPU where the "
        "op has a Triton kernel and triton runs, else torch, the plain-PyTorch reference).",
    )

    @field_validator("backend")
    @classmethod
    def _known(cls, v: Optional[str]) -> Optional[str]:
        if v not in (None, "auto", "torch", "triton"):
            raise ValueError(f"unknown backend {v!r}; choose auto, torch or triton")
        return v


class SSMCacheTransformConfig(InsertCachedStateConfig):
    ssm_replay: bool = Field(
        default=False,
        description="Enable the replay SSM kernel (tl.dot fast-forward) for the MTP extend path. Requires SM >= 80 "
        "(Ampere+). The workbench has no MTP/speculative extend path, so only false is accepted.",
    )

    @field_validator("ssm_replay")
    @classmethod
    def _no_replay(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "ssm_replay=true needs the MTP (speculative) extend path, which the workbench does not "
                "have; leave it false"
            )
        return v


def _pick_backend(requested: Optional[str], op: StatefulOp, device: torch.device, field: str) -> Tuple[str, str]:
    """(backend, why) for one op: the requested one, or auto's choice (``state_backends(op).choose``)."""
    table = state_backends(op)
    if requested not in (None, "auto") and requested not in table:
        raise ValueError(
            f"backend {requested!r} has no cached kernel for {op.source} (available: {list(table.names())}); "
            f"set {field}: torch (runs everywhere) or auto"
        )
    choice = table.choose(requested, device, field)
    return choice.name, choice.why


# A subclass names its own config class (``_InsertCachedState[SSMCacheTransformConfig]``) or keeps this one.
_StateConfigT = TypeVar("_StateConfigT", bound=InsertCachedStateConfig, default=InsertCachedStateConfig)


class _InsertCachedState(Transform[_StateConfigT]):
    """Rewrite every stateful op node owned by this key into its cached op over state slots."""

    provides = (CACHE_SPECS,)
    mechanism = ""  # e.g. "causal conv", for messages

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            raise TypeError(f"{self.key} rewrites exported graphs, and this model is not exported")
        nodes = stateful_nodes(gm, self.key)
        if not nodes:
            owned = sorted(op.source.split("::")[1] for op in stateful_ops().values() if op.insert_key == self.key)
            return gm, TransformInfo(
                num_matches=0,
                skip_reason=f"no {self.mechanism} nodes ({', '.join(owned) or 'no op'}"
                " not in the graph: this model has none, or export did not canonicalize them)",
            )
        device = ctx.device
        specs: List[CacheSpec] = []
        backends: Dict[str, str] = {}
        for i, (node, op) in enumerate(nodes):
            backend, why = _pick_backend(self.config.backend, op, device, f"{self.key}.backend")
            backends[op.source.split("::")[1]] = f"{backend} ({why})"
            specs.extend(rewrite_stateful_node(gm, node, op, backend, i, ctx.dtype, device))
        gm.graph.lint()
        gm.recompile()
        ctx.cache.declare(specs, ctx.dtype, ctx.limits.page_size)
        per_seq = sum(s.token_elems() * (s.dtype or ctx.dtype).itemsize for s in specs)
        details = {
            "backend": backends,
            "layers": sorted({s.layer for s in specs if s.layer is not None}),
            "states": {s.name: list(s.shape) for s in specs},
            "state_bytes_per_sequence": per_seq,
            "new_inputs": ["seq_lens", "input_pos", "slot_idx", "num_prefill"] + [s.name for s in specs],
        }
        return gm, TransformInfo(num_matches=len(nodes), is_clean=True, has_valid_shapes=True, details=details)


@register("insert_cached_ssm_attention")
class SSMCacheTransform(_InsertCachedState[SSMCacheTransformConfig]):
    """The state-space recurrences -> their cached forms over per-sequence states: Mamba-2 scans
    (``torch_ssm``, state [heads, head_dim, d_state]), Mamba-1 selective scans (``torch_selective_scan``,
    [d_inner, d_state]) and RG-LRU recurrences (``torch_rglru``, [lru_width])."""

    mechanism = "SSM scan"


@register("insert_cached_causal_conv")
class InitializeCausalConvCache(_InsertCachedState):
    """Short depthwise causal convs -> cached convs over a per-sequence window of the last k-1 inputs."""

    mechanism = "causal conv"


@register("insert_cached_delta_rule")
class InsertCachedDeltaRule(_InsertCachedState):
    """Delta-rule linear attention -> cached recurrence over a per-sequence state [heads, d_k, d_v]."""

    mechanism = "delta rule"


@register("insert_cached_gated_delta_rule")
class InsertCachedGatedDeltaRule(_InsertCachedState):
    """Gated delta-rule linear attention -> cached recurrence over a per-sequence state [heads, d_k, d_v]."""

    mechanism = "gated delta rule"


@register("insert_cached_linear_attention")
class InsertCachedLinearAttention(_InsertCachedState):
    """Decayed linear attention (MiniMax lightning) -> cached recurrence over a per-sequence state
    [heads, d_k, d_v]."""

    mechanism = "linear attention"


__all__ = [
    "SSMCacheTransform",
    "InitializeCausalConvCache",
    "InsertCachedDeltaRule",
    "InsertCachedGatedDeltaRule",
    "InsertCachedLinearAttention",
    "InsertCachedStateConfig",
    "SSMCacheTransformConfig",
]
