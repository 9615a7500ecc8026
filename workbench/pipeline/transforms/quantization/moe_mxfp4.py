"""``quantize_mxfp4_moe`` (stage ``pattern_matcher``, after ``match_moe_pattern``): gpt-oss's MXFP4
experts from the checkpoint.

``torch_moe_fused`` -> ``torch_mxfp4_moe`` (weight-only): gpt-oss ``experts.gate_up_proj_blocks``
[E, 2I, H/32, 16] are viewed as [E, 2I, H/2] (``mxfp4_blocks_for_op``), the scales bound as stored,
and the stacked fp32 experts of the dequantized twin dropped from the graph. ``torch_mxfp4_moe``
takes every option of gpt-oss's experts (``ops/moe/expert_mlp.py``): expert biases, interleaved
gate/up rows and the clamped SwiGLU are carried over -- the FP8 / FP8_BLOCK / NVFP4 MoE ops of
``moe.py`` have none of them.

The transform also takes the reference's kernel choice (``backend``, ``trtllm_quant_act``); this
build has neither kernel, so it reports which op runs and why (``resolve_mxfp4_kernel``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
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


# ------------------------------------------------------------------------------ declared conversion
def mxfp4_blocks_for_op(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``_blocks`` [E, N, K/32, 16] -> the op's [E, N, K/2] (a view: same bytes)."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]) if blocks.dim() == 4 else blocks


# ------------------------------------------------------------------------------ the rewrite
def stacked_target(node: Any) -> Optional[str]:
    """The stacked parameter a ``torch_moe_fused`` weight argument reads: a ``get_attr`` itself, or
    one seen through the ``transpose(1, 2)`` view the gpt-oss pattern puts on its ``[in, out]`` experts."""
    if isinstance(node, fx.Node) and node.target == aten.transpose.int and tuple(node.args[1:]) in ((1, 2), (-2, -1)):
        return get_attr_target(node.args[0])
    return get_attr_target(node)


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
        nodes = call_nodes(gm, wb.torch_moe_fused.default)
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
            blocks, meta = ck.tensors[f"{name}_blocks"], tensor_meta(w)
            want = tuple(meta.shape) if meta is not None else None
            got = (*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2) if blocks.dim() == 4 else None
            if want is not None and got != want:
                return (
                    f"{name}_blocks {tuple(blocks.shape)} hold [E, out, in] = {got}, the experts read {want} "
                    "(nn.Linear layout): not this model's layout"
                )
        return None


__all__ = [
    "QuantizeMxfp4Moe",
    "QuantizeMxfp4MoeConfig",
    "resolve_mxfp4_kernel",
    "stacked_target",
    "mxfp4_blocks_for_op",
]
