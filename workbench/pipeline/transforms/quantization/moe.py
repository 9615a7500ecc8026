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
==================================  ==========  ==========================================================

``torch_moe_fused`` nodes with gpt-oss's options (expert biases, interleaved gate/up rows, clamped
SwiGLU: ``ops/moe/expert_mlp.py``) go to ``torch_mxfp4_moe`` only (``quantize_mxfp4_moe``,
``moe_mxfp4.py``), which takes them all; the FP8 / FP8_BLOCK / NVFP4 MoE ops have none of them, so
these transforms leave such a node alone and name the options in ``details["left"]``.

Per-expert checkpoints store ``<experts>.<e>.gate_proj.weight`` etc. (``QuantizedCheckpoint.expert_modules``
finds them, Mixtral's ``w1/w3/w2`` spelling too); the graph gets the stacked tensors under the
twin's names with the checkpoint's suffixes (``experts.gate_up_proj``, ``experts.gate_up_proj_weight_scale``,
``experts.down_proj_input_scale``...). The requantizations are exact when the checkpoint already
shares the scales (as ModelOpt writes projections meant to be fused, and ``tiny_quantized`` does).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.fx as fx

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
    get_attr_target,
    nothing_to_do,
    replace_node,
)

wb = torch.ops.workbench


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


# ------------------------------------------------------------------------------ the rewrite
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
    nodes = call_nodes(gm, wb.torch_moe_fused.default)
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


__all__ = [
    "QuantizeFp8Moe",
    "QuantizeFinegrainedFp8Moe",
    "QuantizeNvfp4Moe",
    "quantize_moe",
    "stack_fp8_gate_up",
    "stack_fp8_block_gate_up",
    "stack_nvfp4_gate_up",
    "stack_experts",
]
