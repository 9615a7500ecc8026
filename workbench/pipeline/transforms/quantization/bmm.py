"""FP8 batched matmuls from the checkpoint's quant config (stage ``pattern_matcher``):
``quantize_fp8_bmm_from_config``.

``bmm(x [B, M, K], W [B, K, N])`` whose weight an FP8 checkpoint stores in float8_e4m3fn, with
per-tensor ``weight_scale`` and ``input_scale`` beside it, becomes ``torch_fp8_bmm``. Scale names:
a module weight ``m.weight`` has ``m.weight_scale`` / ``m.input_scale``; a bare parameter ``p``
(stacked expert weights, say) has ``p_weight_scale`` / ``p_input_scale``. Llama-4's experts are
such BMMs (``save_tiny_quantized("llama4_text", "FP8")`` stores them so, as ModelOpt does):
``match_bmm_moe_pattern`` leaves FP8-stored experts to this transform. The other tiny MoE
architectures' experts go through ``torch_moe_fused`` (``quantize_fp8_moe``): 0 matches there.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....models.quantized_checkpoint import bmm_scale_names
from ...context import PipelineContext
from ...graph.utils import call_nodes
from ...interface import Transform, TransformInfo, register, rewrite_info
from .graph import (
    GraphTensors,
    QuantizeFromConfigConfig,
    attr_users_elsewhere,
    checkpoint_skip_reason,
    get_attr_target,
    nothing_to_do,
    replace_node,
    scalar_fp32,
)

aten = torch.ops.aten
wb = torch.ops.workbench


@register("quantize_fp8_bmm_from_config")
class QuantizeFp8BmmFromConfig(Transform[QuantizeFromConfigConfig]):
    """FP8 checkpoints: ``bmm(x [B, M, K], W [B, K, N])`` on a weight stored in fp8 (with per-tensor
    ``weight_scale`` and ``input_scale``) -> ``torch_fp8_bmm``."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        reason = checkpoint_skip_reason(ctx, self.key, ("FP8",))
        if reason:
            return nothing_to_do(gm, reason)
        ck = ctx.checkpoint
        assert ck is not None  # checkpoint_skip_reason saw its quantization config
        cfg = ck.config.with_excluded(*self.config.exclude_modules)
        t = GraphTensors(gm, ck.tensors)
        done, left = [], []
        for node in call_nodes(gm, aten.bmm.default):
            weight = get_attr_target(node.args[1])
            if weight is None:
                continue
            name = ck.checkpoint_name(weight)
            ws, xs = bmm_scale_names(name)
            w = ck.tensors.get(name)
            if w is None or w.dtype != torch.float8_e4m3fn or ws not in ck or xs not in ck:
                left.append(name)
                continue
            if cfg.is_excluded(name.rsplit(".", 1)[0]) or attr_users_elsewhere(gm, weight, node):
                left.append(name)
                continue
            stem = weight[: -len("weight")] if weight.endswith(".weight") else weight + "_"
            t.bind(weight, [name])
            t.bind(stem + "input_scale", [xs], scalar_fp32)
            t.bind(stem + "weight_scale", [ws], scalar_fp32)
            args = [t.node(n, node) for n in (weight, stem + "input_scale", stem + "weight_scale")]
            replace_node(gm, node, wb.torch_fp8_bmm.default, (node.args[0], *args), {}, t, replaced=[node.args[1]])
            done.append(name)
        gm, info = rewrite_info(gm, len(done), {"quantized": done, "left": left})
        if not done:
            info = info.model_copy(update={"skip_reason": "no bmm reads a weight the checkpoint stores in fp8"})
        return gm, info


__all__ = ["QuantizeFp8BmmFromConfig"]
