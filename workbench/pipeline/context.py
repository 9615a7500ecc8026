"""The explicit, typed context every transform receives, instead of globals or a blackboard dict.

What flows from ``Workbench(...)`` to generated tokens, and which transform adds it:

=============================  =====================================================================
``limits: RuntimeLimits``       made once from the ``Workbench`` arguments (max_batch_size,
                                max_seq_len, max_num_tokens, page_size); a transform field that
                                overrides one writes it here and the override is reported
``weights``                     the eager model's tensors by graph name (stepper); ``load_weights``
                                binds the meta-traced graph to them. For a quantized checkpoint
                                it also carries the raw quantized tensors (``WeightSource.checkpoint``)
``checkpoint``                  the quantized checkpoint the model came from (``loaded.checkpoint``:
                                its ``QuantConfig`` and raw tensors), None otherwise; the
                                ``quantize_*_from_config`` transforms read ``ctx.quant_config``
``hidden_states_to_capture``    ``detect_hidden_states_for_capture``: layer -> node name
``hf_attn_layers``              ``detect_hf_attn_layers`` (transformers mode)
``cache: CacheState``           ``insert_cached_attention`` / ``insert_cached_residual_add`` /
                                ``transformers_replace_cached_attn`` declare specs (``declare``);
                                ``initialize_cache`` / ``resize_kv_cache`` allocate the config and
                                tensors; the probe follows the specs
``runner``                      ``compile_model`` (None: ``generate`` builds the plain runner)
``dist: DistInfo``              this process's rank in a sharded run (``Workbench(world_size=N)``,
                                ``torchrun``); world size 1 otherwise. ``detect_sharding`` plans
                                for it, ``sharding_transform_executor`` writes ``sharding``
``sharding``                    the applied plan (``ShardingPlan``), None when nothing was sharded
=============================  =====================================================================

Re-running a notebook cell builds a new context, so nothing leaks between runs. The stepper keeps
a ``ContextState`` (a shallow, immutable copy of the mutable parts) in every snapshot and restores it
on rewind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..runtime.interface import CachedProbe, CacheSpec, KVCacheConfig, RuntimeLimits, add_specs
from .weights import with_checkpoint

if TYPE_CHECKING:
    from ..models.loaded import LoadedModel
    from ..models.quantized_checkpoint import QuantizedCheckpoint
    from ..ops.backends import AttentionBackend
    from ..ops.registry import Choice
    from ..quantization.checkpoint_config import QuantConfig
    from ..runtime.runner import Runner
    from .transforms.caches.transformers_mode import HFAttnLayer
    from .transforms.export.export_cache import ExportCache
    from .transforms.sharding.plan import ShardingPlan


class PipelineOrderError(RuntimeError):
    """A transform ran before the one that provides what it needs."""


@dataclass(frozen=True, eq=False)
class Fact:
    """Something a transform leaves in the context for later ones, compared by identity.

    ``present(ctx)``: whether the context holds it. ``required``: a transform that needs it cannot
    run without it (the framework raises ``PipelineOrderError``); otherwise the transform says
    itself what it does without (a skip reason)."""

    name: str
    present: Callable[[Any], bool]
    required: bool = False

    def __str__(self) -> str:
        return self.name


# The facts transforms leave for each other (``Transform.provides`` / ``needs``), each checked
# against the context field that holds it.
SHARDING_PLAN = Fact("sharding plan", lambda ctx: ctx.sharding is not None)
HF_ATTENTION_LAYERS = Fact(
    "attention layers (detect_hf_attn_layers)", lambda ctx: bool(ctx.hf_attn_layers), required=True
)
CACHE_SPECS = Fact("cache specs", lambda ctx: bool(ctx.cache.specs))
KV_CACHE = Fact("KV cache", lambda ctx: ctx.cache.config is not None)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a sharded run: its rank, the world size and the process group the
    collective ops name (``torch.distributed`` functional collectives take the group by name).

    World size 1 (the default) means no process group exists and nothing is sharded.
    """

    rank: int = 0
    world_size: int = 1
    group_name: str = ""  # torch.distributed process group name; "" when world_size == 1
    backend: str = ""  # "gloo" | "nccl"; "" when world_size == 1

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.world_size > 1 and not self.group_name:
            raise ValueError("a DistInfo with world_size > 1 needs the process group's name (group_name)")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (every rank must call it, at the same point). For choices
        each rank measures on its own -- the CPU calibration's timings, noisy on a loaded machine:
        ranks that chose differently build different graphs and their collectives part."""
        if not self.sharded:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


@dataclass
class CacheState:
    """Everything about the caches: declared specs, the allocated pool and its tensors, the probe.

    ``declare`` is the one way to add specs: it merges them (same name, same spec: kept once;
    conflicting: an error) and refreshes the numerics probe to feed the new inputs.
    """

    specs: Tuple[CacheSpec, ...] = ()
    config: Optional[KVCacheConfig] = None
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)  # by graph input name
    probe: Optional[CachedProbe] = None
    # the cached-attention backend the graph calls and why it was chosen (insert_cached_attention,
    # transformers_replace_cached_attn); None before the cache stage
    attention: Optional["Choice[AttentionBackend]"] = None

    def declare(self, specs: Sequence[CacheSpec], dtype: torch.dtype, page_size: int) -> Tuple[CacheSpec, ...]:
        self.specs = add_specs(self.specs, specs)
        self.probe = CachedProbe(self.specs, dtype, page_size)
        return self.specs

    def require_specs(self, key: str) -> Tuple[CacheSpec, ...]:
        if not self.specs:
            raise PipelineOrderError(
                f"{key} needs cache specs, and none were declared: run insert_cached_attention (or "
                "transformers_replace_cached_attn) before it"
            )
        return self.specs

    def require_config(self, key: str) -> KVCacheConfig:
        if self.config is None:
            raise PipelineOrderError(
                f"{key} needs the allocated KV cache, and there is none: run initialize_cache before it"
            )
        return self.config

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy(self) -> "CacheState":
        return dataclasses.replace(self, tensors=dict(self.tensors))


@dataclass(frozen=True)
class ContextState:
    """The mutable part of a context as it was after one transform (kept in its snapshot)."""

    limits: RuntimeLimits
    cache: CacheState
    runner: Optional["Runner"]
    hidden_states_to_capture: Mapping[int, str]
    hf_attn_layers: Tuple["HFAttnLayer", ...]
    sharding: Optional["ShardingPlan"] = None


@dataclass
class PipelineContext:
    spec: str
    loaded: Optional["LoadedModel"]  # model, config, tokenizer; None: a standalone context
    device: torch.device
    dtype: torch.dtype
    limits: RuntimeLimits = field(default_factory=RuntimeLimits)
    cache: CacheState = field(default_factory=CacheState)
    runner: Optional["Runner"] = None  # built by compile_model; None: generate builds the plain runner
    hidden_states_to_capture: Dict[int, str] = field(default_factory=dict)
    hf_attn_layers: Tuple["HFAttnLayer", ...] = ()
    # The quantized checkpoint the model was loaded from (its QuantConfig and raw tensors); None
    # for other models. Defaults to ``loaded.checkpoint``.
    checkpoint: Optional["QuantizedCheckpoint"] = None
    dist: DistInfo = field(default_factory=DistInfo)
    sharding: Optional["ShardingPlan"] = None  # once sharding_transform_executor applied one
    # transforms/export/export_cache.ExportCache when the run reuses graphs earlier processes exported
    export_cache: Optional["ExportCache"] = None
    _weights: Optional[Mapping[str, torch.Tensor]] = field(default=None, repr=False)

    def __post_init__(self):
        if self.checkpoint is None and self.loaded is not None:
            self.checkpoint = getattr(self.loaded, "checkpoint", None)

    @property
    def weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """The eager model's tensors by graph attribute name (``pipeline.weights.WeightSource``):
        what ``load_weights`` (and the numerics probe, before it) binds the meta-traced graph to.
        When the model came from a quantized checkpoint, the checkpoint's raw tensors are attached
        on assignment (``WeightSource.checkpoint``), so every reader sees both."""
        return self._weights

    @weights.setter
    def weights(self, source: Optional[Mapping[str, torch.Tensor]]) -> None:
        self._weights = with_checkpoint(source, self.checkpoint.tensors if self.checkpoint is not None else None)

    @property
    def quant_config(self) -> Optional["QuantConfig"]:
        """The checkpoint's quantization config (None: the model is not a quantized checkpoint)."""
        return self.checkpoint.config if self.checkpoint is not None else None

    @classmethod
    def standalone(
        cls,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        checkpoint: Optional["QuantizedCheckpoint"] = None,
    ) -> "PipelineContext":
        """A context for running one transform on a graph of your own, outside a ``Workbench``
        (no model behind it: ``config`` and ``vocab_size`` are unavailable). ``checkpoint``: a
        ``QuantizedCheckpoint`` (config + raw tensors) for the quantization transforms."""
        return cls(spec="standalone", loaded=None, device=torch.device(device), dtype=dtype, checkpoint=checkpoint)

    @property
    def config(self) -> Any:
        if self.loaded is None:
            raise AttributeError("this is a standalone context (PipelineContext.standalone): it has no model config")
        return self.loaded.config

    @property
    def vocab_size(self) -> int:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(text.vocab_size)  # a vision-language config keeps it in its text config

    def cache_bytes(self) -> int:
        return self.cache.bytes()

    def state(self) -> ContextState:
        return ContextState(
            self.limits,
            self.cache.copy(),
            self.runner,
            dict(self.hidden_states_to_capture),
            tuple(self.hf_attn_layers),
            self.sharding,
        )

    def restore(self, state: Optional[ContextState], limits: RuntimeLimits) -> None:
        """Back to ``state`` (None: as a fresh context with ``limits``)."""
        if state is None:
            self.limits, self.cache, self.runner = limits, CacheState(), None
            self.hidden_states_to_capture, self.hf_attn_layers = {}, ()
            self.sharding = None
            return
        self.limits, self.cache, self.runner = state.limits, state.cache.copy(), state.runner
        self.hidden_states_to_capture = dict(state.hidden_states_to_capture)
        self.hf_attn_layers = tuple(state.hf_attn_layers)
        self.sharding = state.sharding


__all__ = ["PipelineContext", "RuntimeLimits", "DistInfo", "CacheState", "ContextState", "PipelineOrderError"]
