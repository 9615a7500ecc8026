"""Quantized MoE experts from the checkpoint (stage ``pattern_matcher``, after ``match_moe_pattern``).

``torch_moe_fused(x, selected, weights, w1_w3 [E, 2I, H], w2 [E, H, I])`` reads the stacked experts of
the dequantized twin. When the checkpoint stores them quantized, these transforms swap in the
quantized MoE op and bind its tensors from the checkpoint:

==================================  ==========  ==========================================================
key                                 quant_algo  op; how the stacked tensors are made at load
==================================  ==========  ==========================================================
``quantize_fp8_moe``                FP8         ``torch_fp8_moe``: per-expert fp8 weights stacked, gate and
                                                up requantized to one scale when theirs differ
``quantize_finegrained_fp8_moe``    FP8_BLOCK   ``torch_finegrained_fp8_moe``: fp8 weights and their
                                                ``weight_scale_inv`` stacked (gate, up tiled apart)
``quantize_nvfp4_moe``              NVFP4       ``torch_nvfp4_moe``: packed weights and block scales
                                                stacked; gate/up block scales rescaled to one global scale
                                                when theirs differ
``quantize_mxfp4_moe``              MXFP4       ``torch_mxfp4_moe``: gpt-oss ``experts.gate_up_proj_blocks``
                                                [E, 2I, H/32, 16] viewed as [E, 2I, H/2], scales as stored;
                                                biases, interleaved gate/up rows and clamped SwiGLU carried
==================================  ==========  ==========================================================

``torch_moe_fused`` nodes with gpt-oss's options (expert biases, interleaved gate/up rows, clamped
SwiGLU: ``ops/moe/expert_mlp.py``) go to ``torch_mxfp4_moe`` only, which takes them all; the FP8 /
FP8_BLOCK / NVFP4 MoE ops have none of them, so those transforms leave such a node alone and name
the options in ``details["left"]``. ``quantize_mxfp4_moe`` also takes the reference's kernel choice
(``backend``, ``trtllm_quant_act``); this build has neither kernel, so it reports which op runs and why.

Per-expert checkpoints store ``<experts>.<e>.gate_proj.weight`` etc. (``QuantizedCheckpoint.expert_modules``
finds them, Mixtral's ``w1/w3/w2`` spelling too); the graph gets the stacked tensors under the
twin's names with the checkpoint's suffixes (``experts.gate_up_proj``, ``experts.gate_up_proj_weight_scale``,
``experts.down_proj_input_scale``...). The requantizations are exact when the checkpoint already
shares the scales (as ModelOpt writes projections meant to be fused, and ``tiny_quantized`` does).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.moe.torch_moe import has_expert_extras
from ....ops.quant import codecs
from ...context import PipelineContext
from ...graph.utils import call_nodes
from ...graph.weights import fetch_attr
from ...interface import Transform, TransformInfo, register, rewrite_info
from ...matcher import named_args
from .graph import (
    GraphTensors,
    QuantizeFromConfigConfig,
    checkpoint_skip_reason,
    drop_unread_attrs,
    get_attr_target,
    nothing_to_do,
    replace_node,
)

wb = torch.ops.workbench
aten = torch.ops.aten
logger = logging.getLogger("workbench.pipeline")


# ------------------------------------------------------------------------------ declared conversions
def stack_fp8_gate_up(*tensors: torch.Tensor, experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate weights (E), up weights (E), gate scales, up scales, gate input scales, up input scales ->
    (w1_w3 fp8 [E, 2I, H], weight scale [E], input scale [E]). Gate and up are requantized to the
    larger of their scales (exact when equal); their input is the same, so its scale is the larger too."""
    gates, ups = tensors[:experts], tensors[experts : 2 * experts]
    gs, us = tensors[2 * experts : 3 * experts], tensors[3 * experts : 4 * experts]
    gis, uis = tensors[4 * experts : 5 * experts], tensors[5 * experts :]
    weights, scales = [], []
    for g, u, a, b in zip(gates, ups, gs, us):
        a, b = a.float().reshape(()), b.float().reshape(())
        scale = torch.maximum(a, b)
        weights.append(codecs.to_fp8(torch.cat([g.float() * a, u.float() * b]), scale))
        scales.append(scale)
    inputs = [torch.maximum(a.float().reshape(()), b.float().reshape(())) for a, b in zip(gis, uis)]
    return torch.stack(weights), torch.stack(scales), torch.stack(inputs)


def stack_experts(*tensors: torch.Tensor) -> torch.Tensor:
    """Per-expert tensors -> one stacked [E, ...] (one-element scales become [E])."""
    return torch.stack([t.reshape(()) if t.numel() == 1 and t.dim() <= 1 else t for t in tensors])


def stack_fp8_block_gate_up(*tensors: torch.Tensor, experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """gate weights, up weights, gate scale_inv, up scale_inv (E each) -> (w1_w3 [E, 2I, H],
    scale_inv [E, 2 * ceil(I/bn), ceil(H/bk)]): gate and up tiled apart, which the op reads as is."""
    gates, ups = tensors[:experts], tensors[experts : 2 * experts]
    gs, us = tensors[2 * experts : 3 * experts], tensors[3 * experts :]
    return (
        torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]),
        torch.stack([torch.cat([a, b]) for a, b in zip(gs, us)]),
    )


def stack_nvfp4_gate_up(*tensors: torch.Tensor, experts: int):
    """gate/up packed weights, block scales, global scales, input scales (E each) -> (w1_w3 [E, 2I, H/2],
    block scales [E, 2I, H/16], global [E], input [E]). Block scales are re-expressed against the larger
    global scale of the pair (exact when equal); the e2m1 codes are kept."""
    e = experts
    gw, uw, gbs, ubs, gg, ug, gi, ui = (tensors[i * e : (i + 1) * e] for i in range(8))
    packed, block_scales, globals_, inputs = [], [], [], []
    for i in range(e):
        a, b = gg[i].float().reshape(()), ug[i].float().reshape(())
        top = torch.maximum(a, b)
        packed.append(torch.cat([gw[i], uw[i]]))
        block_scales.append(
            torch.cat([codecs.to_fp8(gbs[i].float() * (a / top), 1.0), codecs.to_fp8(ubs[i].float() * (b / top), 1.0)])
        )
        globals_.append(top)
        inputs.append(torch.maximum(gi[i].float().reshape(()), ui[i].float().reshape(())))
    return torch.stack(packed), torch.stack(block_scales), torch.stack(globals_), torch.stack(inputs)


def mxfp4_blocks_for_op(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``_blocks`` [E, N, K/32, 16] -> the op's [E, N, K/2] (a view: same bytes)."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]) if blocks.dim() == 4 else blocks


# ------------------------------------------------------------------------------ the rewrite
def _moe_nodes(gm: fx.GraphModule):
    return call_nodes(gm, wb.torch_moe_fused.default)


def _names(per_expert, suffix: str) -> List[str]:
    return [f"{m}.{suffix}" for m in per_expert]


class _Plan:
    """One format: which per-expert tensors it needs and how the op's arguments are bound."""

    op: Any
    suffixes: Tuple[str, ...]

    def arguments(self, t: GraphTensors, w13: str, w2: str, experts, e: int, before: fx.Node) -> List[Any]:
        raise NotImplementedError


class _FP8(_Plan):
    op = wb.torch_fp8_moe.default
    suffixes = ("weight", "weight_scale", "input_scale")

    def arguments(self, t, w13, w2, ex, e, before):
        gate_up = [
            *_names(ex.gate, "weight"),
            *_names(ex.up, "weight"),
            *_names(ex.gate, "weight_scale"),
            *_names(ex.up, "weight_scale"),
            *_names(ex.gate, "input_scale"),
            *_names(ex.up, "input_scale"),
        ]
        for i, target in enumerate((w13, f"{w13}_weight_scale", f"{w13}_input_scale")):
            t.bind(target, gate_up, stack_fp8_gate_up, output=i, experts=e)
        t.bind(w2, _names(ex.down, "weight"), stack_experts)
        t.bind(f"{w2}_weight_scale", _names(ex.down, "weight_scale"), stack_experts)
        t.bind(f"{w2}_input_scale", _names(ex.down, "input_scale"), stack_experts)
        names = (w13, w2, f"{w13}_input_scale", f"{w2}_input_scale", f"{w13}_weight_scale", f"{w2}_weight_scale")
        return [t.node(n, before) for n in names]


class _FineGrainedFP8(_Plan):
    op = wb.torch_finegrained_fp8_moe.default
    suffixes = ("weight", "weight_scale_inv")

    def __init__(self, block: Tuple[int, int]):
        self.block = block

    def arguments(self, t, w13, w2, ex, e, before):
        gate_up = [
            *_names(ex.gate, "weight"),
            *_names(ex.up, "weight"),
            *_names(ex.gate, "weight_scale_inv"),
            *_names(ex.up, "weight_scale_inv"),
        ]
        t.bind(w13, gate_up, stack_fp8_block_gate_up, output=0, experts=e)
        t.bind(f"{w13}_weight_scale_inv", gate_up, stack_fp8_block_gate_up, output=1, experts=e)
        t.bind(w2, _names(ex.down, "weight"), stack_experts)
        t.bind(f"{w2}_weight_scale_inv", _names(ex.down, "weight_scale_inv"), stack_experts)
        names = (w13, w2, f"{w13}_weight_scale_inv", f"{w2}_weight_scale_inv")
        return [t.node(n, before) for n in names]

    def tail(self) -> Dict[str, Any]:
        return {"block_n": self.block[0], "block_k": self.block[1]}


class _NVFP4(_Plan):
    op = wb.torch_nvfp4_moe.default
    suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def arguments(self, t, w13, w2, ex, e, before):
        gate_up = [n for s in self.suffixes for n in (*_names(ex.gate, s), *_names(ex.up, s))]
        targets = (w13, f"{w13}_weight_scale", f"{w13}_weight_scale_2", f"{w13}_input_scale")
        for i, target in enumerate(targets):
            t.bind(target, gate_up, stack_nvfp4_gate_up, output=i, experts=e)
        for s in self.suffixes:
            t.bind(w2 if s == "weight" else f"{w2}_{s}", _names(ex.down, s), stack_experts)
        names = (
            w13,
            w2,
            f"{w13}_weight_scale",
            f"{w2}_weight_scale",
            f"{w13}_weight_scale_2",
            f"{w2}_weight_scale_2",
            f"{w13}_input_scale",
            f"{w2}_input_scale",
        )
        return [t.node(n, before) for n in names]


def quantize_moe(
    gm: fx.GraphModule, ctx, key: str, algo: str, plan: _Plan, exclude: Sequence[str] = ()
) -> Tuple[fx.GraphModule, TransformInfo]:
    reason = checkpoint_skip_reason(ctx, key, (algo,))
    if reason:
        return nothing_to_do(gm, reason)
    nodes = _moe_nodes(gm)
    if not nodes:
        return nothing_to_do(gm, "no torch_moe_fused nodes (a dense model, or match_moe_pattern did not run)")
    ck, cfg = ctx.checkpoint, ctx.quant_config.with_excluded(*exclude)
    t = GraphTensors(gm, ck.tensors)
    done, left = [], []
    for node in nodes:
        args = dict(named_args(node))
        extras = has_expert_extras(args)
        if extras:
            left.append(f"{node.name}: {', '.join(extras)} ({plan.op.name()} has none)")
            continue
        w13, w2 = get_attr_target(args["w1_w3_stacked"]), get_attr_target(args["w2_stacked"])
        if w13 is None or w2 is None:
            left.append(f"{node.name}: experts are not plain graph tensors")
            continue
        experts_module = ck.checkpoint_name(w13.rsplit(".", 1)[0])
        num = int(fetch_attr(gm, w13).shape[0])
        ex = ck.expert_modules(experts_module, num)
        if cfg.is_excluded(experts_module) or ex is None:
            left.append(
                f"{experts_module}: {'excluded' if ex is not None else 'not stored per expert in the checkpoint'}"
            )
            continue
        missing = [f"{m}.{s}" for m in ex.gate + ex.up + ex.down for s in plan.suffixes if f"{m}.{s}" not in ck]
        if missing:
            left.append(f"{experts_module}: the checkpoint lacks {missing[:3]} ({len(missing)} in all)")
            continue
        new_args = plan.arguments(t, w13, w2, ex, num, node)
        kwargs = {"act_fn": args["act_fn"]} if args["act_fn"] != "silu" else {}
        kwargs.update(getattr(plan, "tail", dict)())
        replace_node(
            gm, node, plan.op, (args["x"], args["selected_experts"], args["routing_weights"], *new_args), kwargs, t
        )
        done.append(experts_module)
    gm, info = rewrite_info(gm, len(done), {"quant_algo": cfg.quant_algo, "quantized": done, "left": left})
    if not done:
        info = info.model_copy(update={"skip_reason": "; ".join(left)})
    return gm, info


@register("quantize_fp8_moe")
class QuantizeFp8Moe(Transform[QuantizeFromConfigConfig]):
    """FP8 checkpoints: ``torch_moe_fused`` -> ``torch_fp8_moe`` (per-expert tensors stacked at load)."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return quantize_moe(gm, ctx, self.key, "FP8", _FP8(), self.config.exclude_modules)


@register("quantize_finegrained_fp8_moe")
class QuantizeFinegrainedFp8Moe(Transform[QuantizeFromConfigConfig]):
    """Fine-grained FP8 checkpoints: ``torch_moe_fused`` -> ``torch_finegrained_fp8_moe``."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        cfg = ctx.quant_config
        block = cfg.weight_block_size if cfg is not None and cfg.weight_block_size else (128, 128)
        return quantize_moe(gm, ctx, self.key, "FP8_BLOCK", _FineGrainedFP8(block), self.config.exclude_modules)


@register("quantize_nvfp4_moe")
class QuantizeNvfp4Moe(Transform[QuantizeFromConfigConfig]):
    """NVFP4 checkpoints: ``torch_moe_fused`` -> ``torch_nvfp4_moe`` (per-expert tensors stacked at load)."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return quantize_moe(gm, ctx, self.key, "NVFP4", _NVFP4(), self.config.exclude_modules)


# ------------------------------------------------------------------------------ MXFP4
def stacked_target(node: Any) -> Optional[str]:
    """The stacked parameter a ``torch_moe_fused`` weight argument reads: a ``get_attr`` itself, or
    one seen through the ``transpose(1, 2)`` view the gpt-oss pattern puts on its ``[in, out]`` experts."""
    if isinstance(node, fx.Node) and node.target == aten.transpose.int and tuple(node.args[1:]) in ((1, 2), (-2, -1)):
        return get_attr_target(node.args[0])
    return get_attr_target(node)


def _stacked_shape(node: fx.Node) -> Optional[Tuple[int, ...]]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if val is not None else None


def resolve_mxfp4_kernel(backend: Optional[str], trtllm_quant_act: str, device: torch.device) -> Dict[str, Any]:
    """Which MXFP4 MoE kernel ``backend`` asks for on ``device``, as the reference resolves it, and what
    runs here: None -> trtllm on SM >= 100, else triton; trtllm below SM 100 -> triton (warned).
    Neither a Triton MXFP4 MoE kernel (triton_kernels' ``matmul_ogs``) nor TensorRT-LLM is part of
    this build, so ``torch_mxfp4_moe`` (the torch reference) runs whatever the choice."""
    sm = torch.cuda.get_device_capability(device) if device.type == "cuda" and torch.cuda.is_available() else None
    where = f"SM {sm[0]}{sm[1]}" if sm else f"no CUDA device ({device.type})"
    notes: List[str] = []
    if backend is None:
        resolved = "trtllm" if sm is not None and sm >= (10, 0) else "triton"
        notes.append(f"backend None: the SM-based default is {resolved} ({where})")
    elif backend == "trtllm" and (sm is None or sm < (10, 0)):
        resolved = "triton"
        notes.append(f"backend trtllm needs SM >= 100 ({where}): falls back to triton")
        logger.warning("quantize_mxfp4_moe: backend trtllm needs SM >= 100 (%s); falling back to triton", where)
    else:
        resolved = backend
    notes.append(
        f"this build has no {resolved} MXFP4 MoE kernel (no triton_kernels matmul_ogs, no TensorRT-LLM): "
        "torch_mxfp4_moe runs, the torch reference (experts dequantized per call, fp32 GEMMs, "
        "activations unquantized)"
    )
    if resolved == "trtllm":
        notes.append(
            f"trtllm_quant_act={trtllm_quant_act} recorded for the trtllm kernel; the torch reference "
            "does not quantize activations"
        )
    else:
        notes.append(f"trtllm_quant_act={trtllm_quant_act} recorded, unused: it applies to the trtllm kernel only")
    return {
        "backend_requested": backend,
        "backend_resolved": resolved,
        "trtllm_quant_act": trtllm_quant_act,
        "kernel": "torch_mxfp4_moe (torch reference)",
        "kernel_notes": notes,
    }


class QuantizeMxfp4MoeConfig(QuantizeFromConfigConfig):
    """``quantize_mxfp4_moe``: the checkpoint's exclusions plus the reference's kernel choice."""

    backend: Optional[Literal["triton", "trtllm"]] = Field(
        default=None,
        description="MXFP4 MoE kernel: None (SM-based default: trtllm on SM >= 100, triton otherwise), "
        "'triton' or 'trtllm' (below SM 100 it falls back to triton with a warning). Neither kernel is "
        "in this build: the transform says in its info which op runs (torch_mxfp4_moe) and why.",
    )
    trtllm_quant_act: Literal["bf16", "mxfp8"] = Field(
        default="mxfp8",
        description="Activation format of the trtllm kernel ('mxfp8' quantizes the activations, 'bf16' "
        "keeps them); used with backend trtllm only, validated and recorded in the info.",
    )


@register("quantize_mxfp4_moe")
class QuantizeMxfp4Moe(Transform[QuantizeMxfp4MoeConfig]):
    """MXFP4 checkpoints (gpt-oss layout): ``torch_moe_fused`` -> ``torch_mxfp4_moe`` (weight-only);
    the stacked fp32 experts are dropped from the graph. Expert biases, interleaved gate/up rows and
    the clamped SwiGLU of gpt-oss are carried over (the biases stay the twin's tensors: transformers
    keeps them unquantized)."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        reason = checkpoint_skip_reason(ctx, self.key, ("MXFP4",))
        if reason:
            return nothing_to_do(gm, reason)
        nodes = _moe_nodes(gm)
        if not nodes:
            return nothing_to_do(gm, "no torch_moe_fused nodes (a dense model, or match_moe_pattern did not run)")
        ck = ctx.checkpoint
        assert ck is not None  # checkpoint_skip_reason saw its quantization config
        cfg = ck.config.with_excluded(*self.config.exclude_modules)
        t = GraphTensors(gm, ck.tensors)
        done, left, dropped = [], [], []
        for node in nodes:
            args = dict(named_args(node))
            weights = [args["w1_w3_stacked"], args["w2_stacked"]]
            targets = [stacked_target(w) for w in weights]
            names = [ck.checkpoint_name(x) if x else None for x in targets]
            first = names[0]
            if first is not None and None not in names and cfg.is_excluded(first.rsplit(".", 1)[0]):
                left.append(f"{first.rsplit('.', 1)[0]}: excluded")
                continue
            if first is None or None in names or any(f"{n}_blocks" not in ck or f"{n}_scales" not in ck for n in names):
                left.append(f"{names}: no _blocks/_scales in the checkpoint")
                continue
            mismatch = self._layout_mismatch(ck, [n for n in names if n is not None], weights)
            if mismatch:
                left.append(mismatch)
                continue
            biases = [args["w1_w3_bias"], args["w2_bias"]]
            stored = [n for n, b in zip(names, biases) if f"{n}_bias" in ck and b is None]
            if stored:
                left.append(f"{stored}: the checkpoint has expert biases this torch_moe_fused node does not carry")
                continue
            new = []
            for target, name, bias in zip(targets, names, biases):
                t.bind(f"{target}_blocks", [f"{name}_blocks"], mxfp4_blocks_for_op)
                t.bind(f"{target}_scales", [f"{name}_scales"])
                new.append([t.node(f"{target}_blocks", node), t.node(f"{target}_scales", node), bias])
            kwargs = {k: args[k] for k in ("act_fn", "gate_up_interleaved", "swiglu_alpha", "swiglu_limit")}
            replace_node(
                gm,
                node,
                wb.torch_mxfp4_moe.default,
                (args["x"], args["selected_experts"], args["routing_weights"], *new[0], *new[1]),
                kwargs,
                t,
                replaced=weights,
            )
            dropped += [x for x in targets if x is not None]  # both are (their names are)
            done.append(first.rsplit(".", 1)[0])
        drop_unread_attrs(gm, dropped)
        kernel = resolve_mxfp4_kernel(self.config.backend, self.config.trtllm_quant_act, ctx.device)
        gm, info = rewrite_info(gm, len(done), {"quantized": done, "left": left, **kernel})
        if not done:
            info = info.model_copy(update={"skip_reason": "; ".join(left)})
        return gm, info

    @staticmethod
    def _layout_mismatch(ck, names: List[str], weights: List[fx.Node]) -> Optional[str]:
        """Why the stored ``_blocks`` [E, N, K/32, 16] do not fit the op's ``[E, N, K]`` weights, or None."""
        for name, w in zip(names, weights):
            blocks, want = ck.tensors[f"{name}_blocks"], _stacked_shape(w)
            got = (*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2) if blocks.dim() == 4 else None
            if want is not None and got != want:
                return (
                    f"{name}_blocks {tuple(blocks.shape)} hold [E, out, in] = {got}, the experts read {want} "
                    "(nn.Linear layout): not this model's layout"
                )
        return None


__all__ = [
    "QuantizeFp8Moe",
    "QuantizeFinegrainedFp8Moe",
    "QuantizeNvfp4Moe",
    "QuantizeMxfp4Moe",
    "QuantizeMxfp4MoeConfig",
    "resolve_mxfp4_kernel",
    "stacked_target",
    "quantize_moe",
    "stack_fp8_gate_up",
    "stack_fp8_block_gate_up",
    "stack_nvfp4_gate_up",
    "stack_experts",
    "mxfp4_blocks_for_op",
]
