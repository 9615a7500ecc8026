"""Stage ``export``: ``export_to_gm`` turns the wrapped HF model into a torch.fx GraphModule.

Non-strict ``torch.export`` behind the contract ``(input_ids, position_ids) -> logits`` with dynamic
batch and sequence dims.

Device-neutral by default: the traced module is a weightless ``meta`` twin of the model
(``models.build.meta_twin``), so the graph is the same whatever device the weights will run on, and
tracing a big model costs no copy of it. The graph's tensors stay on ``meta`` until ``load_weights``
(stage ``weight_load``) binds them; until then the numerics probe runs it through
``pipeline.unloaded_run.run_unloaded``. ``trace_device: model`` traces the model where its weights are
(the graph then shares them), for comparison.

Dynamic dims: ``Dim.DYNAMIC`` with the pipeline's bounds, not named ``Dim``s. Under torch 2.11 a
named sequence ``Dim`` fails on every device (``Constraints violated (seq)``: export cannot prove
guards such as ``min(64*seq, 192*seq) == 64*seq`` for the declared range, although they hold for every
size); ``Dim.DYNAMIC`` lets export keep such guards as facts, and works on 2.11 and 2.13 alike. The
price is that export assumes sizes >= 2 (its 0/1 specialisation) and reports ranges from 2; the
graph is checked to have kept both dims symbolic, and tests run it at batch 1 and sequence 1.

The parts: ``device_branches.py`` (the rewrites that make a meta trace match a CPU trace),
``forward_constants.py`` (tensors made inside the forward, recovered from a CPU trace),
``few_experts.py`` (``num_moe_experts_for_export``), ``stamp.py`` (layer stamping),
``export_cache.py`` (a repeat run reads the graph instead of tracing it).
"""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Tuple

import torch
import torch.fx as fx
from pydantic import Field, field_validator

from ....models.build import meta_twin, to_empty_keep_ties
from ....models.export_contract import CausalLMLogits, make_batch
from ....models.loaded import describe_model_class
from ...context import PipelineContext
from ...graph.copy import GraphCopy
from ...graph.utils import remove_tensor_metadata_asserts
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...weights import TRACE_DEVICE_KEY, record_forward_constant
from .device_branches import normalize_device_branches
from .export_cache import ExportCache, export_key, read_graph, store_graph
from .few_experts import cut_experts, restore_experts
from .forward_constants import constant_values, forget_meta_constants, meta_constants
from .patches import EXPORT_PATCHES, apply_patches, resolve_patches
from .specialized_dims import DIM_NAMES, draft_export, explain_specialized_dim, is_specialized_dim_error
from .stamp import TRACED, stamp_layers, truncated, why_not_stampable


class ExportToGMConfig(TransformConfig):
    expect_mem_change: bool = Field(
        default=True,
        description="The graph module comes into being here: it holds no bytes when traced on meta, "
        "the model's (shared) bytes with trace_device=model.",
    )
    trace_device: Literal["meta", "model"] = Field(
        default="meta",
        description="'meta': trace a weightless meta twin of the model (device-neutral; the weights "
        "are bound by load_weights at stage weight_load). 'model': trace the model where its weights "
        "are (the graph shares them).",
    )
    normalize_device_branches: bool = Field(
        default=True,
        description="Undo what the trace device decided without changing values: drop "
        "aten.contiguous nodes whose only users are reshapes (present or not depending on the trace "
        "device's kernel strides), count histc bins on float ids (HF picks int ids off CPU, "
        "which CPU histc rejects) and read tensors made in forward without aten.lift_fresh_copy "
        "(absent on meta) when nothing writes to the copy. The meta and CPU traces then have the same ops.",
    )
    strict: bool = Field(default=False, description="Use strict (dynamo) export instead of non-strict.")
    patches: Dict[str, bool] = Field(
        default_factory=dict,
        description="Switch export patches on/off by name (others keep their default). "
        f"Known: {sorted(EXPORT_PATCHES)}.",
    )
    example_batch_size: int = Field(
        default=2, ge=2, description="Batch size of the example inputs (>= 2 so it stays dynamic)."
    )
    example_seq_len: int = Field(
        default=8, ge=2, description="Sequence length of the example inputs (>= 2 so it stays dynamic)."
    )
    max_batch_size: Optional[int] = Field(
        default=None,
        ge=2,
        description="Upper bound of the dynamic batch dim; None: the pipeline's "
        "max_batch_size (set here, it overrides it for the rest of the pipeline).",
    )
    max_seq_len: Optional[int] = Field(
        default=None,
        ge=2,
        description="Upper bound of the dynamic sequence dim; None: the pipeline's "
        "max_seq_len (set here, it overrides it for the rest of the pipeline).",
    )
    stamp_repeated_layers: bool = Field(
        default=True,
        description="When every decoder layer is the same module with the same configuration, export "
        "the model cut to 3 layers, check that layers 1 and 2 are the same graph, and append copies "
        "of layer 2 for the rest (each with its own weights): ~0.25 s per layer saved; the graph is "
        "the full export's, node for node (export_stamp.py). Falls back to a full export, with the "
        "reason in the details, whenever a check fails. Only with trace_device=meta.",
    )
    num_moe_experts_for_export: Optional[int] = Field(
        default=None,
        ge=1,
        description="Trace stacked MoE experts with only this many experts (the reference: often "
        "required when the expert count is large, >64), then restore the graph's expert tensors to "
        "all experts before load_weights binds them; None: trace all experts. Only with trace_device=meta.",
    )
    remove_tensor_metadata_asserts: bool = Field(
        default=True,
        description="Drop aten._assert_tensor_metadata nodes that export adds around .to() calls; "
        "they check nothing the graph can violate and get in the way of pattern matching.",
    )

    @field_validator("patches")
    @classmethod
    def _known_patches(cls, v: Dict[str, bool]) -> Dict[str, bool]:
        resolve_patches(v)
        return v


@register("export_to_gm")
class ExportToGM(Transform[ExportToGMConfig]):
    def _apply(self, mod: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        cfg = self.config
        if isinstance(mod, torch.fx.GraphModule):
            raise TypeError("export_to_gm got a GraphModule: the model is already exported")
        # Its bounds are the pipeline's limits; set here, they override them (and are reported).
        ctx.limits = ctx.limits.override(self.key, max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len)
        # export treats sizes 0/1 as special and infers dynamic dims as >= 2: a bound of 2 would leave the
        # range [2, 2] and make export refuse the dim as static. A bound above the runtime limit only
        # loosens the graph's guards (the runtime never feeds more than its limits), so export with >= 3.
        max_b, max_s = max(ctx.limits.max_batch_size, 3), max(ctx.limits.max_seq_len, 3)
        for what, size, bound in (("batch", cfg.example_batch_size, max_b), ("seq", cfg.example_seq_len, max_s)):
            if size > bound:
                raise ValueError(
                    f"example_{what}_{'size' if what == 'batch' else 'len'}={size} is above the dynamic "
                    f"{what} dim's upper bound {bound}: lower it, or raise max_{what}_{'size' if what == 'batch' else 'len'}"
                )
        mod, model_class = _model_to_export(mod, ctx)
        cache, key = _export_cache_for(mod, cfg, ctx, (max_b, max_s))
        read, cache_note = read_graph(cache, key)
        if read is not None:
            return read
        traced, trace_device = _module_to_trace(mod, cfg.trace_device)
        # {} unless num_moe_experts_for_export
        few_experts = cut_experts(traced, cfg.num_moe_experts_for_export, cfg.trace_device)
        example = make_batch(ctx.vocab_size, cfg.example_batch_size, cfg.example_seq_len, seed=0, device=trace_device)
        batch = torch.export.Dim.DYNAMIC(min=1, max=max_b)
        seq = torch.export.Dim.DYNAMIC(min=1, max=max_s)
        dyn = ({0: batch, 1: seq}, {0: batch, 1: seq})
        patches = resolve_patches(cfg.patches)

        def export(module: torch.nn.Module):
            with apply_patches(patches, module), torch.inference_mode(False), torch.no_grad():
                try:
                    return torch.export.export(module, example.args, dynamic_shapes=dyn, strict=cfg.strict)
                except Exception as e:
                    if not is_specialized_dim_error(e):
                        raise
                    why = explain_specialized_dim(module, lambda: draft_export(module, example.args, dyn), DIM_NAMES)
                    if why is None:
                        raise
                    raise ValueError(why) from e

        stamping = _stamp_plan(traced, ctx, cfg)
        ep = gm = None
        stamped_path: Optional[str] = None  # the layer stack the exported module was cut at, if it was
        if isinstance(stamping, tuple):
            path, layers = stamping
            ep = export(truncated(traced, path, TRACED))
            gm = ep.module()
            try:
                stamping = stamp_layers(gm, path, layers)
                stamped_path = path
            except ValueError as e:
                stamping = f"full export: {e}"
                ep = gm = None
                traced, _ = _module_to_trace(mod, cfg.trace_device)
                few_experts = cut_experts(traced, cfg.num_moe_experts_for_export, cfg.trace_device)
        if gm is None:
            ep = export(traced)
            gm = ep.module()
        assert ep is not None  # exported with gm
        made = meta_constants(gm, ep)
        if made:  # tensors made in forward, lifted without values: recover them (forward_constants.py)
            cpu_twin = to_empty_keep_ties(meta_twin(mod), torch.device("cpu"))
            if stamped_path is not None:
                cpu_twin = truncated(cpu_twin, stamped_path, TRACED)
            cpu_example = make_batch(ctx.vocab_size, cfg.example_batch_size, cfg.example_seq_len, seed=0, device="cpu")
            with apply_patches(patches, cpu_twin), torch.inference_mode(False), torch.no_grad():
                cpu_ep = torch.export.export(cpu_twin, cpu_example.args, dynamic_shapes=dyn, strict=cfg.strict)
            for target, value in constant_values(made, cpu_ep).items():
                record_forward_constant(gm, target, value)
            forget_meta_constants(gm, made)
        ranges = _check_dynamic(gm, ep)
        removed = remove_tensor_metadata_asserts(gm) if cfg.remove_tensor_metadata_asserts else 0
        normalized = normalize_device_branches(gm) if cfg.normalize_device_branches else {}
        gm.meta["range_constraints"] = {str(k): str(v) for k, v in ep.range_constraints.items()}
        gm.meta["export_patches"] = [p.name for p in patches]
        gm.meta["dynamic_dims"] = {"batch": (1, max_b), "seq": (1, max_s)}
        gm.meta[TRACE_DEVICE_KEY] = str(trace_device)
        if few_experts:
            restore_experts(gm, few_experts)
        gm.graph.eliminate_dead_code()
        # A lazily recompiled copy (graph/utils.py: lazy_graph_module): later rewrites regenerate the
        # code only when it runs. Same graph, tensors, buffers, meta and hooks.
        gm = GraphCopy(gm).module
        info = TransformInfo(
            num_matches=1,
            is_clean=True,
            has_valid_shapes=True,
            details={
                "patches": [p.name for p in patches],
                "asserts_removed": removed,
                "trace_device": str(trace_device),
                "export_ranges": ranges,
                "normalized": normalized,
                "torch": torch.__version__,
                "layers": stamping,
                "forward_constants": {k: list(v.shape) for k, v in made.items()},
                "model_class": model_class,
                **(
                    {"moe_experts_traced": {k: [few_experts["n"], *v[1:]] for k, v in few_experts["shapes"].items()}}
                    if few_experts
                    else {}
                ),
                "summary": f"{model_class.split(' (')[0]} traced on {trace_device} with torch "
                f"{torch.__version__}; dims batch {ranges['batch']}, seq {ranges['seq']} "
                "(export's ranges; 1 works too)",
            },
        )
        if cache is not None:
            info.details["export_cache"] = store_graph(cache, key, gm, info, made, cache_note)
        return gm, info


def _export_cache_for(mod: torch.nn.Module, cfg: ExportToGMConfig, ctx, bounds) -> Tuple[Optional[ExportCache], str]:
    """The run's export cache and this export's key; (None, "") when the run keeps none or the
    graph would hold weight values (traced off meta)."""
    cache = getattr(ctx, "export_cache", None)
    if cache is None or cfg.trace_device != "meta":
        return None, ""
    return cache, export_key(mod, cfg, bounds, ctx.vocab_size)


def _model_to_export(mod: torch.nn.Module, ctx) -> Tuple[torch.nn.Module, str]:
    """(the module to export, its model class for the details). When ``load_model`` built a custom
    canonical-op model for this config (``LoadedModel.export_model``, sharing the HF model's tensors
    under the same names), it is exported in place of the HF model the stepper wraps; the HF model
    stays the numerics reference."""
    loaded = getattr(ctx, "loaded", None)
    if (
        isinstance(mod, CausalLMLogits)
        and loaded is not None
        and mod.model is loaded.model
        and getattr(loaded, "export_model", None) is not None
    ):
        return CausalLMLogits(loaded.export_model), loaded.export_model_class
    inner = mod.model if isinstance(mod, CausalLMLogits) else mod
    described = describe_model_class(inner, custom=False)
    fallback = getattr(loaded, "custom_fallback", None) if loaded is not None else None
    return mod, f"{described}; {fallback}" if fallback else described


def _stamp_plan(traced: torch.nn.Module, ctx, cfg: ExportToGMConfig):
    """(layer stack path, the full stack) when the layers can be stamped, else why not (a string)."""
    if not cfg.stamp_repeated_layers:
        return "full export (stamp_repeated_layers: false)"
    if cfg.trace_device != "meta":
        return "full export (layer stamping needs trace_device=meta)"
    config = next((m.config for m in traced.modules() if hasattr(m, "config")), None)
    why, path = why_not_stampable(traced, config)
    if why is not None:
        return f"full export: {why}"
    assert path is not None  # stampable: the stack's path is known
    return path, traced.get_submodule(path)


def _module_to_trace(mod: torch.nn.Module, how: str) -> Tuple[torch.nn.Module, torch.device]:
    """The module export traces and the device its example inputs go on."""
    if how == "meta":
        return meta_twin(mod), torch.device("meta")
    first = next(iter([*mod.parameters(), *mod.buffers()]), None)
    return mod, (first.device if first is not None else torch.device("cpu"))


def _check_dynamic(gm: fx.GraphModule, ep: Any) -> Dict[str, str]:
    """Both input dims must have stayed symbolic; returns export's range for each.

    ``Dim.DYNAMIC`` never raises when the model specialises a dim (it would with a named Dim): a
    model that, say, reshapes with a constant sequence length would give a graph that only accepts
    the example's size. That must fail here, naming the dim, not at the first decode step.
    """
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids = inputs[0].meta.get("val") if inputs else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise RuntimeError("export_to_gm: the exported graph's first input is not a [batch, seq] tensor")
    out: Dict[str, str] = {}
    for dim, name in enumerate(("batch", "seq")):
        size = ids.shape[dim]
        if not isinstance(size, torch.SymInt):
            raise RuntimeError(
                f"export_to_gm: the {name} dim was specialised to {size} while tracing, so the graph "
                f"would only accept {name} == {size}. Something in the model's forward depends on the "
                "concrete size; run torch.export.draft_export on the model to see which guard did it."
            )
        expr = size.node.expr
        out[name] = str(ep.range_constraints.get(expr, "unbounded"))
    return out
