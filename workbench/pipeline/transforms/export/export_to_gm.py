"""Stage ``export``: ``export_to_gm`` turns the wrapped HF model into a torch.fx GraphModule.

Non-strict ``torch.export`` behind the contract ``(input_ids, position_ids) -> logits`` with dynamic
batch and sequence dims.

Device-neutral by default: the traced module is a weightless ``meta`` twin of the model
(``models.build.meta_twin``), so the graph is the same whatever device the weights will run on, and
tracing a big model costs no copy of it. The graph's tensors stay on ``meta`` until ``load_weights``
(stage ``weight_load``) binds them; until then the numerics probe runs it through
``pipeline.weights.run_unloaded``. ``trace_device: model`` traces the model where its weights are
(the graph then shares them), for comparison.

Dynamic dims: ``Dim.DYNAMIC`` with the pipeline's bounds, not named ``Dim``s. Under torch 2.11 a
named sequence ``Dim`` fails on every device (``Constraints violated (seq)``: export cannot prove
guards such as ``min(64*seq, 192*seq) == 64*seq`` for the declared range, although they hold for every
size); ``Dim.DYNAMIC`` lets export keep such guards as facts, and works on 2.11 and 2.13 alike. The
price is that export assumes sizes >= 2 (its 0/1 specialisation) and reports ranges from 2; the
graph is checked to have kept both dims symbolic, and tests run it at batch 1 and sequence 1.

One stride fact is device-dependent and is normalised away: HF attention ends in
``attn_output.transpose(1, 2).contiguous().reshape(...)``. Whether ``contiguous`` is a no-op (and so
absent from the trace) depends on the strides the trace device's SDPA kernel returns: on CPU it is
absent, on ``meta`` it is a real node. ``reshape`` copies when it must, so a ``contiguous`` whose
only users are reshapes changes no value; it is dropped (``drop_contiguous_before_reshape``) and
the meta and CPU traces have the same op histogram. The second is HF's own device branch in the
grouped-MoE forward (histc on int ids off CPU): see ``histc_on_float``.

Tensors made inside ``forward`` from Python data -- ``torch.tensor([...], device=x.device)``, or an
index list (Falcon's multi-query split ``fused_qkv[..., [-2], :]`` makes an index tensor on the
input's device inside ``Tensor.__getitem__``) -- are constants to export, which lifts them into the
graph as attributes (``<module>.lifted_tensor_<n>``). Made on ``meta``, they have no values, and
nothing in the eager model holds them. Their values cannot depend on the weights (export would
have traced the computation instead), only on the code path, so they are recovered from a second
export of the same (truncated) module on ``cpu`` with uninitialised weights (``torch.empty``: never
read, as export fakes them; the pages are never touched), matched by name, shape and dtype, and
recorded (``weights.record_forward_constant``); ``load_weights`` binds them like weights. The
second export runs only when the first lifted such tensors (most models lift none). Why not
intercept the creation calls while tracing on meta: the index tensor of ``x[..., [i]]`` is made in
C++ with Python dispatch excluded, so no mode sees it -- re-tracing on a device that keeps data
covers every way a forward can make a constant.

``num_moe_experts_for_export: N`` traces every stacked-experts module (transformers'
``@use_experts_implementation`` experts) with its stacked tensors cut to their first N experts, then
gives the graph's expert tensors back their full size (still on ``meta``) and re-derives the fake
values: ``load_weights`` binds all experts. The traced ops are the same for any expert count -- the
experts' forward reads the count from ``num_experts`` (kept whole, like the router), never from the
weights' shape -- so the graph equals a full export's. Experts that read the count from their
weights (Llama-4's ``view(gate_up_proj.shape[0], ...)``) are refused.
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
from ...graph.utils import remove_tensor_metadata_asserts, run_shape_prop
from ...graph.weights import fake_value, fetch_attr
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...weights import TRACE_DEVICE_KEY, record_forward_constant
from .export_cache import ExportCache, Uncacheable, checked_record, export_key, module_of
from .patches import EXPORT_PATCHES, apply_patches, resolve_patches
from .stamp import TRACED, stamp_layers, truncated, why_not_stampable

aten = torch.ops.aten


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
        read, cache_note = _read_cached(cache, key)
        if read is not None:
            return read
        traced, trace_device = _module_to_trace(mod, cfg.trace_device)
        few_experts = _cut_experts(traced, cfg)  # {} unless num_moe_experts_for_export
        example = make_batch(ctx.vocab_size, cfg.example_batch_size, cfg.example_seq_len, seed=0, device=trace_device)
        batch = torch.export.Dim.DYNAMIC(min=1, max=max_b)
        seq = torch.export.Dim.DYNAMIC(min=1, max=max_s)
        dyn = ({0: batch, 1: seq}, {0: batch, 1: seq})
        patches = resolve_patches(cfg.patches)

        def export(module: torch.nn.Module):
            with apply_patches(patches, module), torch.inference_mode(False), torch.no_grad():
                return torch.export.export(module, example.args, dynamic_shapes=dyn, strict=cfg.strict)

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
                few_experts = _cut_experts(traced, cfg)
        if gm is None:
            ep = export(traced)
            gm = ep.module()
        assert ep is not None  # exported with gm
        made = _meta_constants(gm, ep)
        if made:  # tensors made in forward, lifted without values: recover them (module docstring)
            cpu_twin = to_empty_keep_ties(meta_twin(mod), torch.device("cpu"))
            if stamped_path is not None:
                cpu_twin = truncated(cpu_twin, stamped_path, TRACED)
            cpu_example = make_batch(ctx.vocab_size, cfg.example_batch_size, cfg.example_seq_len, seed=0, device="cpu")
            with apply_patches(patches, cpu_twin), torch.inference_mode(False), torch.no_grad():
                cpu_ep = torch.export.export(cpu_twin, cpu_example.args, dynamic_shapes=dyn, strict=cfg.strict)
            for target, value in _constant_values(made, cpu_ep).items():
                record_forward_constant(gm, target, value)
            _forget_meta_constants(gm, made)
        ranges = _check_dynamic(gm, ep)
        removed = remove_tensor_metadata_asserts(gm) if cfg.remove_tensor_metadata_asserts else 0
        normalized = normalize_device_branches(gm) if cfg.normalize_device_branches else {}
        gm.meta["range_constraints"] = {str(k): str(v) for k, v in ep.range_constraints.items()}
        gm.meta["export_patches"] = [p.name for p in patches]
        gm.meta["dynamic_dims"] = {"batch": (1, max_b), "seq": (1, max_s)}
        gm.meta[TRACE_DEVICE_KEY] = str(trace_device)
        if few_experts:
            _restore_experts(gm, few_experts)
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
            info.details["export_cache"] = _store(cache, key, gm, info, made, cache_note)
        return gm, info


def _export_cache_for(mod: torch.nn.Module, cfg: ExportToGMConfig, ctx, bounds) -> Tuple[Optional[ExportCache], str]:
    """The run's export cache and this export's key; (None, "") when the run keeps none or the
    graph would hold weight values (traced off meta)."""
    cache = getattr(ctx, "export_cache", None)
    if cache is None or cfg.trace_device != "meta":
        return None, ""
    return cache, export_key(mod, cfg, bounds, ctx.vocab_size)


def _read_cached(cache: Optional[ExportCache], key: str) -> Tuple[Optional[Tuple[fx.GraphModule, TransformInfo]], str]:
    """(the graph and report kept under ``key``, "") on a hit, else (None, what the details will say)."""
    record = cache.get(key) if cache is not None else None
    if record is None:
        return None, "off" if cache is None else "no entry: exported"
    try:
        gm, info = module_of(record)
    except Exception as e:  # noqa: BLE001 - an entry that no longer builds (an op gone): export again
        return None, f"an entry was found but did not build ({type(e).__name__}: {e}); exported again"
    info.details["export_cache"] = f"read ({key[:12]}); export's input guards are not kept"
    info.details["summary"] += " -- read from the export cache"
    return (gm, info), ""


def _store(cache: ExportCache, key: str, gm: fx.GraphModule, info: TransformInfo, made, note: str) -> str:
    """Write ``gm`` to the export cache (after checking it builds back the same); says what happened."""
    if made:
        return f"{note}; not kept: tensors made in the forward ({len(made)})"
    try:
        data = checked_record(gm, info)
    except Uncacheable as e:
        return f"{note}; not kept: {e}"
    except Exception as e:  # noqa: BLE001 - a cache that cannot build its record never fails the export
        return f"{note}; not kept: building the record failed ({type(e).__name__}: {str(e)[:200]})"
    why = cache.put(key, data)
    return f"{note}; {why}" if why else f"{note}; written ({key[:12]})"


def _cut_experts(traced: torch.nn.Module, cfg: ExportToGMConfig) -> Dict[str, Any]:
    """Cut the stacked experts of ``traced`` (a meta twin) to N = ``cfg.num_moe_experts_for_export``.

    Each experts module's ``num_experts`` is set to N too (transformers' grouped GEMM checks that the
    histogram of routed ids has one bin per stacked expert). Returns ``{"shapes": parameter name ->
    full shape, "counts": experts class name -> full count}``, empty when nothing is cut."""
    n = cfg.num_moe_experts_for_export
    if n is None:
        return {}
    if cfg.trace_device != "meta":
        raise ValueError("export_to_gm.num_moe_experts_for_export needs trace_device=meta (it cuts a meta twin)")
    shapes: Dict[str, torch.Size] = {}
    counts: Dict[str, int] = {}
    for path, m in traced.named_modules():
        count = getattr(m, "num_experts", None)
        # transformers' stacked experts: @use_experts_implementation sets _is_expert_parallel
        if not hasattr(m, "_is_expert_parallel") or not isinstance(count, int) or count <= n:
            continue
        cls = f"{type(m).__module__}.{type(m).__qualname__}"
        if counts.setdefault(cls, count) != count:
            raise ValueError(f"export_to_gm.num_moe_experts_for_export: {cls} modules differ in expert count")
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 2 and p.shape[0] == count:  # [E, ...] stacked weights and biases
                shapes[f"{path}.{name}" if path else name] = p.shape
                setattr(m, name, torch.nn.Parameter(p.detach()[:n], requires_grad=False))
        m.num_experts = n
    if not shapes:
        raise ValueError(
            f"export_to_gm.num_moe_experts_for_export={n}: the model has no stacked experts module "
            "(transformers' @use_experts_implementation experts) with more than that many experts"
        )
    return {"n": n, "shapes": shapes, "counts": counts}


# Where transformers' experts forwards put the expert count E in the graph (argument index, offset
# from E): histc(ids, bins=E, min=0, max=E-1); the expert-parallel sentinel test ids >= E and clamps
# to E-1 (no-ops with all experts local).
_EXPERT_COUNT_ARGS = {
    aten.histc.default: ((1, 0), (3, -1)),
    aten.ge.Scalar: ((1, 0),),
    aten.clamp_.default: ((2, -1),),
    aten.clamp.default: ((2, -1),),
}


def _restore_experts(gm: fx.GraphModule, cut: Dict[str, Any]) -> None:
    """Undo ``_cut_experts`` in the graph: the cut expert tensors get their full shape (meta), the
    experts' count literals their full count, and every fake value is re-derived. A graph whose ops
    depended on the cut count elsewhere fails here (or differs from a full export: tests compare)."""
    n, shapes, counts = cut["n"], cut["shapes"], cut["counts"]
    restored = 0
    for name, p in list(gm.named_parameters()):
        shape = shapes.get(name)
        if shape is None or p.shape == shape:
            continue
        owner, _, leaf = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        setattr(module, leaf, torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=False))
        restored += 1
    if restored == 0:
        raise RuntimeError("export_to_gm.num_moe_experts_for_export: no traced expert tensor was found to restore")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in shapes:
            node.meta["val"] = fake_value(gm, fetch_attr(gm, node.target))
        stack = node.meta.get("nn_module_stack") or {}
        owner_cls = list(stack.values())[-1][1] if stack else None
        full = counts.get(owner_cls) if isinstance(owner_cls, str) else None
        if full is None or node.target not in _EXPERT_COUNT_ARGS:
            continue
        args = list(node.args)
        for i, off in _EXPERT_COUNT_ARGS[node.target]:
            if i < len(args) and args[i] == n + off:
                args[i] = full + off
        node.args = tuple(args)
    try:
        run_shape_prop(gm)
    except Exception as e:  # the traced ops read the cut count (e.g. from a weight's shape)
        raise RuntimeError(
            "export_to_gm.num_moe_experts_for_export: the graph traced with fewer experts does not run "
            f"with all of them ({type(e).__name__}: {str(e).splitlines()[0][:200]}); this model's experts "
            "read the expert count from their weights: export with all experts (leave it None)"
        ) from e


def _meta_constants(gm: fx.GraphModule, ep: Any) -> Dict[str, torch.Tensor]:
    """The tensors export lifted from the forward (``lifted_tensor_constants``) that hold no values:
    made on ``meta``. Target name -> the graph module's meta tensor."""
    out: Dict[str, torch.Tensor] = {}
    for target in ep.graph_signature.lifted_tensor_constants:
        try:
            value = fetch_attr(gm, target)
        except AttributeError:  # not read by the unlifted module
            continue
        if isinstance(value, torch.Tensor) and value.is_meta:
            out[target] = value
    return out


def _constant_values(made: Dict[str, torch.Tensor], cpu_ep: Any) -> Dict[str, torch.Tensor]:
    """Each meta constant's value from the CPU export, matched by name, shape and dtype; raises
    naming those the CPU trace did not make the same way (its code path differed)."""
    values, differ = {}, []
    for target, meta in made.items():
        real = cpu_ep.constants.get(target)
        if not isinstance(real, torch.Tensor) or real.is_meta or real.shape != meta.shape or real.dtype != meta.dtype:
            got = f"{tuple(real.shape)} {real.dtype}" if isinstance(real, torch.Tensor) else "nothing"
            differ.append(f"{target} ({tuple(meta.shape)} {meta.dtype}; on cpu: {got})")
            continue
        values[target] = real.detach().clone()
    if differ:
        raise RuntimeError(
            f"export_to_gm: {len(differ)} tensor(s) made inside the model's forward were lifted by export on meta "
            f"without values, and a trace on cpu did not make them the same way: {'; '.join(differ[:4])}. "
            "Export on the model's device instead (export_to_gm.trace_device=model)."
        )
    return values


def _forget_meta_constants(gm: fx.GraphModule, made: Dict[str, torch.Tensor]) -> None:
    """The fake values of the ``get_attr`` nodes reading ``made`` carry their meta tensor as the fake
    tensor's ``constant`` (what fake mode propagates through ops): a constant without data, which
    moving the fake value to the device (``load_weights``) would try to copy. Dropped; the real values
    are recorded."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr" and node.target in made and getattr(val, "constant", None) is not None:
            val.constant = None


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
    return mod, describe_model_class(inner, custom=False)


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


def normalize_device_branches(gm: fx.GraphModule) -> Dict[str, int]:
    """The device-neutralising rewrites (see the module docstring); counts per rewrite."""
    return {
        "contiguous_before_reshape": drop_contiguous_before_reshape(gm),
        "histc_on_float": histc_on_float(gm),
        "lift_fresh_copy": drop_lift_fresh_copy(gm),
    }


def drop_lift_fresh_copy(gm: fx.GraphModule) -> int:
    """Remove ``aten.lift_fresh_copy`` of a lifted constant when nothing mutates the copy.

    A tensor made in forward from Python data (``torch.tensor([...])``, a list index) is read
    through ``lift_fresh_copy`` (a copy, guarding the constant against in-place use) when traced on
    a device with data, and directly when traced on meta. The copy changes no value unless a user
    writes to it; dropped, the meta and CPU traces have the same ops.
    """
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.lift_fresh_copy.default:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "get_attr":
            continue
        schemas = [getattr(u.target, "_schema", None) for u in node.users]
        if any(s is None or s.is_mutable for s in schemas):
            continue  # a user that may write to the copy (or that we cannot tell)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        n += 1
    return n


def histc_on_float(gm: fx.GraphModule) -> int:
    """Make ``histc`` count integer ids cast to float32, not to an integer dtype.

    transformers' grouped-MoE forward casts the sorted expert ids to float on CPU/MPS and to int32
    elsewhere (CUDA's deterministic histc takes ints; CPU histc rejects them). Traced on meta it
    takes the int branch, and that graph cannot run on CPU. Float ids count the same (they are small
    integers, exact in fp32) and run on both, except on CUDA under
    ``torch.use_deterministic_algorithms(True)``.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        src = node.args[0]
        if (
            isinstance(src, fx.Node)
            and src.target is aten.to.dtype
            and len(src.args) >= 2
            and not src.args[1].is_floating_point
            and len(src.users) == 1
        ):
            src.args = (src.args[0], torch.float32, *src.args[2:])
            val = src.meta.get("val")
            if isinstance(val, torch.Tensor):
                src.meta["val"] = val.to(torch.float32)
            n += 1
    return n


def drop_contiguous_before_reshape(gm: fx.GraphModule) -> int:
    """Remove ``aten.contiguous`` nodes whose users are all ``aten.reshape`` (see module docstring)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.contiguous.default:
            continue
        if len(node.args) > 1 or node.kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format:
            continue  # channels-last and friends: a real layout request
        if node.users and all(u.target is aten.reshape.default for u in node.users):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            n += 1
    return n
