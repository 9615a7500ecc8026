"""The ``transformers`` mode of the cache stage: cached inference on the un-exported HF model.

For models that do not export, the runtime can still run paged, continuously batched generation:
the HF modeling code stays as it is and only its attention function is swapped, through
transformers' public ``AttentionInterface`` registration, for one that calls our cached op.

* ``detect_hf_attn_layers`` runs one small forward with a recording attention function and
  stores one ``HFAttnLayer`` per attention call (heads, head dim, scale, window, sinks) in
  ``ctx.hf_attn_layers``.
* ``transformers_replace_cached_attn`` wraps the model in ``HFCachedLM``, whose forward takes the
  same inputs as a cached graph (``input_ids, position_ids, seq_lens, input_pos, page_table,
  num_prefill, k_cache_0, v_cache_0, ...``) and declares the cache specs, so ``initialize_cache``,
  ``resize_kv_cache``, the numerics probe and the runtime treat both modes alike.

The attention functions get everything they need through the forward's keyword arguments (HF
passes unknown ``**kwargs`` down to the attention call), so nothing is stored globally. The one
shared setting, ``config._attn_implementation``, is switched only for the duration of a
``HFCachedLM`` forward and restored afterwards: the eager reference model is the same object.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from pydantic import Field

from ....runtime.interface import METADATA_INPUTS, PAGED, TOKEN_INPUTS, CacheSpec
from ...context import CACHE_SPECS, HF_ATTENTION_LAYERS, PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from .attention_backend import InsertCachedAttentionConfig, LayerShape, resolve_backend

CACHED_IMPL = "workbench_cached"
DETECT_IMPL = "workbench_detect"


@dataclass(frozen=True)
class HFAttnLayer:
    """One attention call of the HF model, as seen by the attention function."""

    index: int  # order of the call in the forward == cache slot
    module_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    sliding_window: Optional[int]
    logit_cap: Optional[float]
    has_sinks: bool


def _hf_model(mod: torch.nn.Module) -> torch.nn.Module:
    if isinstance(mod, torch.fx.GraphModule):
        raise TypeError(
            "the transformers mode works on the un-exported HF model, but this pipeline exported it; "
            "use insert_cached_attention for graphs, or disable export_to_gm and the graph transforms "
            "(transformers_mode_entries() builds such a pipeline)"
        )
    inner = getattr(mod, "model", None)
    return inner if isinstance(inner, torch.nn.Module) and hasattr(inner, "config") else mod


@contextlib.contextmanager
def attn_implementation(config: Any, name: str) -> Iterator[None]:
    """Use attention implementation ``name`` inside the block only."""
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


def _register() -> None:
    """Name our two attention functions in transformers' registry (idempotent, same functions)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DETECT_IMPL, _detect_attention)
    AttentionInterface.register(CACHED_IMPL, _cached_attention)


def _detect_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """Record the call, then compute plain causal attention so the forward continues."""
    record: List[Tuple[torch.nn.Module, Dict[str, Any]]] = kwargs["wb_detect"]
    record.append(
        (
            module,
            dict(
                num_heads=query.shape[1],
                num_kv_heads=key.shape[1],
                head_dim=query.shape[-1],
                v_head_dim=value.shape[-1],
                scale=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                sliding_window=sliding_window,
                logit_cap=softcap,
                has_sinks=getattr(module, "sinks", None) is not None,
            ),
        )
    )
    out = torch.ops.workbench.torch_attention(
        query,
        key,
        value,
        is_causal=True,
        scale=scaling,
        sliding_window=sliding_window,
        logit_cap=softcap,
        sinks=getattr(module, "sinks", None),
    )
    return out.transpose(1, 2).contiguous(), None


@dataclass
class _CachedCall:
    """What one ``HFCachedLM`` forward hands every attention call (via kwargs)."""

    op: Callable
    slots: Dict[torch.nn.Module, int]
    caches: Sequence[torch.Tensor]  # k_0, v_0, k_1, v_1, ...
    seq_lens: torch.Tensor
    input_pos: torch.Tensor
    page_table: torch.Tensor
    num_prefill: int


def _cached_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """HF attention signature -> our cached op. query [b, Hq, s, D], key/value [b, Hkv, s, D]."""
    call: Optional[_CachedCall] = kwargs.get("wb_cached")
    if call is None:
        raise RuntimeError(f"attention implementation {CACHED_IMPL!r} is only usable through HFCachedLM")
    b, hq, s, d = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(1, b * s, x.shape[1], x.shape[-1])  # noqa: E731
    i = call.slots[module]
    out = call.op(
        flat(query),
        flat(key),
        flat(value),
        call.caches[2 * i],
        call.caches[2 * i + 1],
        call.seq_lens,
        call.input_pos,
        call.page_table,
        call.num_prefill,
        float(scaling if scaling is not None else d**-0.5),
        sliding_window=sliding_window,
        logit_cap=softcap,
        sinks=getattr(module, "sinks", None),
    )
    return out.reshape(b, s, hq, value.shape[-1]), None  # HF expects [b, s, Hq, Dv]


class HFCachedLM(torch.nn.Module):
    """The HF model behind the cached-graph calling convention (see module docstring)."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[HFAttnLayer], op: Callable, backend: str):
        super().__init__()
        self.model = model
        self.layers, self.op, self.backend = tuple(layers), op, backend
        self.slots = {model.get_submodule(layer.module_name): layer.index for layer in self.layers}
        self.input_names = (*TOKEN_INPUTS, *METADATA_INPUTS, *[s.name for s in cache_specs(self.layers)])

    def forward(self, input_ids, position_ids, seq_lens, input_pos, page_table, num_prefill, *caches):
        call = _CachedCall(self.op, self.slots, caches, seq_lens, input_pos, page_table, int(num_prefill))
        with attn_implementation(self.model.config, CACHED_IMPL):
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, wb_cached=call)
        return out.logits

    def extra_repr(self) -> str:
        return f"backend={self.backend}, layers={len(self.layers)}"


def cache_specs(layers: Sequence[HFAttnLayer]) -> List[CacheSpec]:
    out = []
    for layer in layers:
        out.append(CacheSpec(f"k_cache_{layer.index}", PAGED, (layer.num_kv_heads, layer.head_dim), None, layer.index))
        out.append(
            CacheSpec(f"v_cache_{layer.index}", PAGED, (layer.num_kv_heads, layer.v_head_dim), None, layer.index)
        )
    return out


class DetectHFAttnLayersConfig(TransformConfig):
    probe_seq_len: int = Field(default=4, ge=1, description="Tokens of the profiling forward.")


@register("detect_hf_attn_layers")
class DetectHFAttnLayers(Transform[DetectHFAttnLayersConfig]):
    """Find the attention layers of the HF model with one recorded forward."""

    provides = (HF_ATTENTION_LAYERS,)

    def _apply(self, mod: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        model = _hf_model(mod)
        _register()
        names = {m: n for n, m in model.named_modules()}
        record: List[Tuple[torch.nn.Module, Dict[str, Any]]] = []
        n = self.config.probe_seq_len
        ids = torch.zeros(1, n, dtype=torch.long, device=ctx.device)
        pos = torch.arange(n, device=ctx.device)[None]
        with torch.no_grad(), attn_implementation(model.config, DETECT_IMPL):
            model(input_ids=ids, position_ids=pos, use_cache=False, wb_detect=record)
        layers = []
        for i, (module, facts) in enumerate(record):
            if module in {m for m, _ in record[:i]}:
                raise ValueError(f"attention module {names[module]} runs twice per forward; not supported")
            layers.append(HFAttnLayer(index=i, module_name=names[module], **facts))
        if not layers:
            raise ValueError("the forward made no attention call through the attention interface")
        ctx.hf_attn_layers = tuple(layers)
        return mod, TransformInfo(
            num_matches=len(layers), details={"layers": len(layers), "first": layers[0].module_name}
        )


class TransformersReplaceCachedAttnConfig(InsertCachedAttentionConfig):
    """The same ``backend`` choice as ``insert_cached_attention`` (one field, one validator)."""


@register("transformers_replace_cached_attn")
class HFReplaceCachedAttn(Transform[TransformersReplaceCachedAttnConfig]):
    """Wrap the HF model so its attention runs on the paged cache (``HFCachedLM``)."""

    needs = (HF_ATTENTION_LAYERS,)
    provides = (CACHE_SPECS,)

    def _apply(self, mod: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        model = _hf_model(mod)
        layers = ctx.hf_attn_layers  # a required need: the framework refused to run without them
        shapes = [LayerShape(x.index, x.head_dim, x.v_head_dim, ctx.dtype, x.has_sinks) for x in layers]
        choice = resolve_backend(self.config.backend, ctx.device, shapes, ctx.dist.agree)
        _register()
        wrapper = HFCachedLM(model, layers, choice.backend.op, choice.name)
        ctx.cache.declare(cache_specs(layers), ctx.dtype, ctx.limits.page_size)
        ctx.cache.attention = choice
        return wrapper, TransformInfo(
            num_matches=len(layers), details={"backend": choice.name, "chosen": choice.why, "layers": len(layers)}
        )


def transformers_mode_entries(backend: str = "torch", **cache_fields: Any):
    """Pipeline entries for the transformers mode: no export, no graph passes, only the cache stage.

    ``Workbench(spec, entries=transformers_mode_entries())``; ``cache_fields`` go to
    ``initialize_cache`` (page_size, max_num_tokens, ...).
    """
    from ...config import resolve_pipeline

    base = {
        "transforms": {
            "detect_hf_attn_layers": {"stage": "cache_init"},
            "transformers_replace_cached_attn": {"stage": "cache_init", "backend": backend},
            "initialize_cache": {"stage": "cache_init", **cache_fields},
            "resize_kv_cache": {"stage": "cache_init"},
        }
    }
    return resolve_pipeline(base=base)


__all__ = [
    "HFAttnLayer",
    "HFCachedLM",
    "DetectHFAttnLayers",
    "HFReplaceCachedAttn",
    "transformers_mode_entries",
    "attn_implementation",
    "CACHED_IMPL",
]
