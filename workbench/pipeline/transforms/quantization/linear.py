"""Quantized linears from the checkpoint's quant config (stage ``pattern_matcher``).

Each ``*_from_config`` transform reads ``ctx.quant_config`` (the checkpoint the model was loaded
from, ``models.quantized_checkpoint``) and rewrites every ``aten.linear`` whose module the checkpoint
stores quantized -- and the config does not exclude -- into the canonical quantized op, through its
format (``linear_formats.py``: what the checkpoint must hold, how the op's tensors are bound):

==========================================  =============  ==============================================
key                                         quant_algo     op (graph tensors, checkpoint names)
==========================================  =============  ==============================================
``quantize_fp8_linear_from_config``         FP8            ``torch_fp8_linear`` (weight fp8, input_scale,
                                                           weight_scale)
``quantize_finegrained_fp8_linear_from_     FP8_BLOCK      ``torch_finegrained_fp8_linear`` (weight fp8,
config``                                                   weight_scale_inv, block from the config)
``quantize_nvfp4_linear_from_config``       NVFP4          ``torch_nvfp4_linear`` (weight, input_scale,
                                                           weight_scale, weight_scale_2)
``quantize_int4_linear_from_config``        W4A16_AWQ      ``torch_int4_awq_linear`` (ModelOpt's packed
                                                           weight repacked at load)
``quantize_int4_gptq_linear_from_config``   W4A16_GPTQ     ``torch_int4_gptq_linear`` (qweight, qzeros,
                                                           scales, g_idx as stored)
==========================================  =============  ==============================================

``quantize_fp8_bmm_from_config`` (FP8 BMMs) lives in ``bmm.py``.

A linear whose weight another node also reads (a tied LM head) is left alone, as are modules the
checkpoint keeps unquantized; the details list them.

Config fields: ``exclude_modules`` adds patterns to the checkpoint's exclude list (those linears run
on the dequantized twin's weights). FP8, fine-grained FP8 and NVFP4 also take
``quantize_unquantized``: full-precision linears (a model with no quant config, e.g. bf16) are
quantized at load from the model's own weights (the seed's ``quantize_weight``), with activation
scales of 1.0 since nothing is calibrated.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....quantization.checkpoint_config import module_matches
from ...context import PipelineContext
from ...graph.utils import call_nodes
from ...graph.weights import linear_bias
from ...interface import Transform, TransformInfo, register, rewrite_info
from .graph import (
    GraphTensors,
    QuantizeFromConfigConfig,
    attr_users_elsewhere,
    checkpoint_skip_reason,
    drop_unread_attrs,
    get_attr_target,
    nothing_to_do,
    replace_node,
)
from .linear_formats import AWQLinear, FineGrainedFP8Linear, FP8Linear, GPTQLinear, LinearFormat, NVFP4Linear

aten = torch.ops.aten


class QuantizeAtLoadConfig(QuantizeFromConfigConfig):
    quantize_unquantized: bool = Field(
        default=False,
        description="Also quantize the linears the model holds in full precision (a model without a quant "
        "config, e.g. bf16; or modules an FP8/NVFP4 checkpoint stores unquantized and does not exclude): the "
        "weights are quantized at load from the model's own tensors (a declared conversion); activation scales "
        "(FP8 input_scale, NVFP4's global input scale) are 1.0, there is no calibration. Tied weights stay.",
    )


def quantize_linears(
    gm: fx.GraphModule,
    ctx,
    key: str,
    algos: Sequence[str],
    fmt: LinearFormat,
    exclude: Sequence[str] = (),
    quantize_unquantized: bool = False,
):
    """Rewrite every checkpoint-quantized ``aten.linear`` of ``gm`` with ``fmt`` (modules matching
    ``exclude`` or the checkpoint's exclude list left alone); see the module docstring.
    ``quantize_unquantized``: full-precision linears too, quantized at load (``fmt.from_model``)."""
    from ....models.quantized_checkpoint import QuantizedCheckpoint

    reason = checkpoint_skip_reason(ctx, key, algos)
    if reason and not (quantize_unquantized and ctx.quant_config is None):
        return nothing_to_do(gm, reason)
    ck = ctx.checkpoint
    cfg = ctx.quant_config.with_excluded(*exclude) if ck is not None else None
    t = GraphTensors(gm, ck.tensors if ck is not None else None, ctx.weights)
    done: List[str] = []
    at_load: List[str] = []
    left: Dict[str, List[str]] = {"excluded": [], "not_quantized_in_checkpoint": [], "tied": [], "unsupported": []}
    dropped: List[str] = []
    for node in call_nodes(gm, aten.linear.default):
        weight = get_attr_target(node.args[1])
        if weight is None or not weight.endswith(".weight"):
            continue
        module = weight[: -len(".weight")]
        name = QuantizedCheckpoint.checkpoint_name(module)
        parts = ck.module(name) if ck is not None else {}
        if cfg.is_excluded(name) if cfg is not None else module_matches(name, exclude):
            left["excluded"].append(name)
            continue
        stored = all(s in parts for s in fmt.required)
        if not stored and not quantize_unquantized:
            left["not_quantized_in_checkpoint"].append(name)
            continue
        problem = fmt.problem(parts, cfg) if stored else fmt.model_problem(t.source("model", weight))
        if problem:
            left["unsupported"].append(f"{name}: {problem}")
            continue
        if attr_users_elsewhere(gm, weight, node):
            left["tied"].append(name)
            continue
        if stored:
            args, kwargs = fmt.arguments(t, module, name, parts, cfg, node)
            done.append(name)
        else:
            args, kwargs = fmt.from_model(t, module, weight, cfg, node)
            at_load.append(name)
        bias = linear_bias(node)
        if bias is not None:
            kwargs["bias"] = bias
        replace_node(gm, node, fmt.op, (node.args[0], *args), kwargs, t, replaced=[node.args[1]])
        if not fmt.replaces_weight:
            dropped.append(weight)
    drop_unread_attrs(gm, dropped)
    details: Dict[str, Any] = {
        "quant_algo": cfg.quant_algo if cfg else None,
        "config_source": cfg.source if cfg else None,
        "quantized": done,
        **({"quantized_at_load": at_load} if at_load else {}),
        **{k: v for k, v in left.items() if v},
    }
    gm, info = rewrite_info(gm, len(done) + len(at_load), details)
    if not done and not at_load:
        what = ", ".join(k for k, v in left.items() if v) or "no linears"
        info = info.model_copy(
            update={
                "skip_reason": f"no linear of this graph is stored as {cfg.quant_algo if cfg else key} "
                f"in the checkpoint ({what})"
            }
        )
    return gm, info


def _linear_transform(key: str, algos: Tuple[str, ...], fmt: LinearFormat, doc: str):
    at_load = type(fmt).from_model is not LinearFormat.from_model

    class LinearQuantization(Transform[QuantizeFromConfigConfig]):
        __doc__ = doc
        config_class = QuantizeAtLoadConfig if at_load else QuantizeFromConfigConfig
        changes_numerics = True

        def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
            return quantize_linears(
                gm,
                ctx,
                self.key,
                algos,
                fmt,
                self.config.exclude_modules,
                getattr(self.config, "quantize_unquantized", False),
            )

    LinearQuantization.__name__ = LinearQuantization.__qualname__ = "".join(p.title() for p in key.split("_"))
    return register(key)(LinearQuantization)


QuantizeFp8LinearFromConfig = _linear_transform(
    "quantize_fp8_linear_from_config",
    ("FP8",),
    FP8Linear(),
    "FP8 checkpoints (per-tensor scales): aten.linear -> torch_fp8_linear.",
)
QuantizeFinegrainedFp8LinearFromConfig = _linear_transform(
    "quantize_finegrained_fp8_linear_from_config",
    ("FP8_BLOCK",),
    FineGrainedFP8Linear(),
    "Fine-grained FP8 checkpoints (weight_scale_inv per block, dynamic 1 x block_k activations): "
    "aten.linear -> torch_finegrained_fp8_linear.",
)
QuantizeNvfp4LinearFromConfig = _linear_transform(
    "quantize_nvfp4_linear_from_config",
    ("NVFP4",),
    NVFP4Linear(),
    "NVFP4 checkpoints (W4A4): aten.linear -> torch_nvfp4_linear.",
)
QuantizeInt4LinearFromConfig = _linear_transform(
    "quantize_int4_linear_from_config",
    ("W4A16_AWQ",),
    AWQLinear(),
    "INT4 AWQ checkpoints (ModelOpt W4A16_AWQ): aten.linear -> torch_int4_awq_linear, the weight repacked at load.",
)
QuantizeInt4GptqLinearFromConfig = _linear_transform(
    "quantize_int4_gptq_linear_from_config",
    ("W4A16_GPTQ",),
    GPTQLinear(),
    "INT4 GPTQ checkpoints (qweight/qzeros/scales/g_idx as stored): aten.linear -> torch_int4_gptq_linear.",
)


__all__ = [
    "quantize_linears",
    "QuantizeFromConfigConfig",
    "QuantizeAtLoadConfig",
    "QuantizeFp8LinearFromConfig",
    "QuantizeFinegrainedFp8LinearFromConfig",
    "QuantizeNvfp4LinearFromConfig",
    "QuantizeInt4LinearFromConfig",
    "QuantizeInt4GptqLinearFromConfig",
]
