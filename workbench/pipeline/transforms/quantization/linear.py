"""Quantized linears from the checkpoint's quant config (stage ``pattern_matcher``).

Each ``*_from_config`` transform reads ``ctx.quant_config`` (the checkpoint the model was loaded
from, ``models.quantized_checkpoint``) and rewrites every ``aten.linear`` whose module the checkpoint
stores quantized -- and the config does not exclude -- into the canonical quantized op:

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
                                                           weight repacked at load, see below)
``quantize_int4_gptq_linear_from_config``   W4A16_GPTQ     ``torch_int4_gptq_linear`` (qweight, qzeros,
                                                           scales, g_idx as stored)
==========================================  =============  ==============================================

``quantize_fp8_bmm_from_config`` (FP8 BMMs) lives in ``quantize_bmm.py``.

Scales stored as [1] are bound as 0-d fp32. AWQ: ModelOpt packs signed int4 codes of two *output*
rows per byte ([N/2, K]); ``torch_int4_awq_linear`` reads ``torch_int4_linear``'s packing along K
([N, K/2], codes + 8, offsets = -8 * scale): ``awq_weight_for_op`` / ``awq_offsets`` are the
declared conversions, run by ``load_weights``. A linear whose weight another node also reads (a
tied LM head) is left alone, as are modules the checkpoint keeps unquantized; the details list them.

Config fields: ``exclude_modules`` adds patterns to the checkpoint's exclude list (those linears run
on the dequantized twin's weights). FP8, fine-grained FP8 and NVFP4 also take
``quantize_unquantized``: full-precision linears (a model with no quant config, e.g. bf16) are
quantized at load from the model's own weights (the seed's ``quantize_weight``), with activation
scales of 1.0 since nothing is calibrated.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.quant import codecs
from ....ops.quant.codecs import gptq_default_g_idx
from ....ops.quant.int4 import RUN, pack_int4
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
    scalar_fp32,
)

aten = torch.ops.aten
wb = torch.ops.workbench


# ------------------------------------------------------------------------------ declared conversions
def awq_weight_for_op(weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt W4A16_AWQ weight uint8 [N/2, K] (signed codes, output rows paired) -> the
    ``torch_int4_linear`` packing uint8 [N, K/2] of the codes + 8 (0..15)."""
    from ....quantization.weights import unpack_int4_from_uint8

    return pack_int4(unpack_int4_from_uint8(weight).to(torch.int16) + 8)


def awq_offsets(weight_scale: torch.Tensor) -> torch.Tensor:
    """Offsets of the symmetric int4 codes + 8: w = (code - 8) * scale = code * scale - 8 * scale."""
    return weight_scale.float() * -8


def gptq_g_idx(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The ``g_idx`` of a checkpoint that stores none: column k in group k // (K / groups)."""
    k = qweight.shape[0] * 8
    return gptq_default_g_idx(k, k // scales.shape[0], device=qweight.device)


# ------------------------------------------------------------------------------ the formats
class LinearFormat:
    """How one format's linears become its op: what the checkpoint must hold, and the op's
    arguments (graph nodes) after the input."""

    op: Any
    required: Tuple[str, ...] = ("weight",)
    replaces_weight = True  # False: the op reads other names (GPTQ's qweight) and weight is dropped

    def problem(self, parts: Mapping[str, torch.Tensor], cfg) -> Optional[str]:
        """Why this module cannot take the op (None when it can)."""
        return None

    def arguments(self, t: GraphTensors, module: str, ck: str, parts, cfg, before: fx.Node) -> Tuple[list, dict]:
        raise NotImplementedError

    def model_problem(self, weight: torch.Tensor) -> Optional[str]:
        """Why a full-precision ``weight`` [N, K] cannot be quantized at load (None when it can)."""
        return None

    def from_model(self, t: GraphTensors, module: str, weight: str, cfg, before: fx.Node) -> Tuple[list, dict]:
        """The op's arguments with the weight quantized at load from the eager tensor ``weight``."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot quantize a full-precision weight at load (it needs calibration data)"
        )


def unit_scale(weight: torch.Tensor) -> torch.Tensor:
    """An activation scale of 1.0 (no calibration when quantizing at load)."""
    return torch.ones((), dtype=torch.float32, device=weight.device)


def fp8_block_quantize_weight(weight: torch.Tensor, block_n: int, block_k: int):
    return codecs.fp8_block_quantize(weight, (block_n, block_k))


def nvfp4_quantize_weight(weight: torch.Tensor):
    return codecs.nvfp4_quantize(weight, None, 16)


class FP8Linear(LinearFormat):
    op = wb.torch_fp8_linear.default
    required = ("weight", "weight_scale", "input_scale")

    def problem(self, parts, cfg):
        if parts["weight"].dtype != torch.float8_e4m3fn:
            return f"weight is {parts['weight'].dtype}, not float8_e4m3fn"
        if parts["weight_scale"].numel() != 1 or parts["input_scale"].numel() != 1:
            return "per-channel scales (torch_fp8_linear takes one per tensor)"
        return None

    def arguments(self, t, module, ck, parts, cfg, before):
        t.bind(f"{module}.weight", [f"{ck}.weight"])
        t.bind(f"{module}.input_scale", [f"{ck}.input_scale"], scalar_fp32)
        t.bind(f"{module}.weight_scale", [f"{ck}.weight_scale"], scalar_fp32)
        return [t.node(f"{module}.{s}", before) for s in ("weight", "input_scale", "weight_scale")], {}

    def from_model(self, t, module, weight, cfg, before):
        t.bind(weight, [weight], codecs.fp8_per_tensor_quantize, namespace="model", output=0)
        t.bind(f"{module}.weight_scale", [weight], codecs.fp8_per_tensor_quantize, namespace="model", output=1)
        t.bind(f"{module}.input_scale", [weight], unit_scale, namespace="model")
        return [t.node(n, before) for n in (weight, f"{module}.input_scale", f"{module}.weight_scale")], {}


class FineGrainedFP8Linear(LinearFormat):
    op = wb.torch_finegrained_fp8_linear.default
    required = ("weight", "weight_scale_inv")

    def problem(self, parts, cfg):
        w, s = parts["weight"], parts["weight_scale_inv"]
        bn, bk = cfg.weight_block_size
        want = (-(-w.shape[0] // bn), -(-w.shape[1] // bk))
        if w.dtype != torch.float8_e4m3fn:
            return f"weight is {w.dtype}, not float8_e4m3fn"
        if tuple(s.shape) != want:
            return f"weight_scale_inv {tuple(s.shape)} does not tile weight {tuple(w.shape)} by {bn}x{bk}"
        return None

    def arguments(self, t, module, ck, parts, cfg, before):
        t.bind(f"{module}.weight", [f"{ck}.weight"])
        t.bind(f"{module}.weight_scale_inv", [f"{ck}.weight_scale_inv"])
        bn, bk = cfg.weight_block_size
        return [t.node(f"{module}.weight", before), t.node(f"{module}.weight_scale_inv", before), bn, bk], {}

    def from_model(self, t, module, weight, cfg, before):
        bn, bk = cfg.weight_block_size if cfg is not None else (128, 128)
        for i, target in enumerate((weight, f"{module}.weight_scale_inv")):
            t.bind(target, [weight], fp8_block_quantize_weight, namespace="model", output=i, block_n=bn, block_k=bk)
        return [t.node(weight, before), t.node(f"{module}.weight_scale_inv", before), bn, bk], {}


class NVFP4Linear(LinearFormat):
    op = wb.torch_nvfp4_linear.default
    required = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def problem(self, parts, cfg):
        w, s = parts["weight"], parts["weight_scale"]
        if w.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn:
            return f"weight {w.dtype} / weight_scale {s.dtype} are not NVFP4's uint8 / float8_e4m3fn"
        if tuple(s.shape) != (w.shape[0], w.shape[1] * 2 // 16):
            return f"weight_scale {tuple(s.shape)} is not one scale per 16 weights of {tuple(w.shape)} (packed)"
        return None

    def arguments(self, t, module, ck, parts, cfg, before):
        t.bind(f"{module}.weight", [f"{ck}.weight"])
        t.bind(f"{module}.input_scale", [f"{ck}.input_scale"], scalar_fp32)
        t.bind(f"{module}.weight_scale", [f"{ck}.weight_scale"])
        t.bind(f"{module}.weight_scale_2", [f"{ck}.weight_scale_2"], scalar_fp32)
        names = ("weight", "input_scale", "weight_scale", "weight_scale_2")
        return [t.node(f"{module}.{s}", before) for s in names], {}

    def model_problem(self, weight):
        return None if weight.shape[-1] % 16 == 0 else f"K = {weight.shape[-1]} is not a multiple of 16"

    def from_model(self, t, module, weight, cfg, before):
        targets = (weight, f"{module}.weight_scale", f"{module}.weight_scale_2")
        for i, target in enumerate(targets):
            t.bind(target, [weight], nvfp4_quantize_weight, namespace="model", output=i)
        t.bind(f"{module}.input_scale", [weight], unit_scale, namespace="model")
        names = (weight, f"{module}.input_scale", f"{module}.weight_scale", f"{module}.weight_scale_2")
        return [t.node(n, before) for n in names], {}


class AWQLinear(LinearFormat):
    op = wb.torch_int4_awq_linear.default
    required = ("weight", "weight_scale")

    def problem(self, parts, cfg):
        w, s = parts["weight"], parts["weight_scale"]
        if w.dtype != torch.uint8 or not s.is_floating_point() or s.dtype == torch.float8_e4m3fn:
            return f"weight {w.dtype} / weight_scale {s.dtype} are not ModelOpt AWQ's uint8 / float"
        n, k = w.shape[0] * 2, w.shape[1]
        if s.dim() != 2 or s.shape[0] != n or k % s.shape[1] or (k // s.shape[1]) % RUN:
            return (
                f"weight_scale {tuple(s.shape)} must be [N={n}, K/group] with a group a multiple of {RUN} "
                f"(torch_int4_linear's packing)"
            )
        return None

    def arguments(self, t, module, ck, parts, cfg, before):
        t.bind(f"{module}.weight", [f"{ck}.weight"], awq_weight_for_op)
        scale = t.bind(f"{module}.weight_scale", [f"{ck}.weight_scale"])
        t.bind(f"{module}.weight_offsets", [f"{ck}.weight_scale"], awq_offsets)
        pqs = None
        if "pre_quant_scale" in parts:
            t.bind(f"{module}.pre_quant_scale", [f"{ck}.pre_quant_scale"])
            pqs = t.node(f"{module}.pre_quant_scale", before)
        group = parts["weight"].shape[1] // scale.shape[1]
        nodes = [t.node(f"{module}.{s}", before) for s in ("weight", "weight_scale", "weight_offsets")]
        return [*nodes, pqs, group], {}


class GPTQLinear(LinearFormat):
    op = wb.torch_int4_gptq_linear.default
    required = ("qweight", "qzeros", "scales")
    replaces_weight = False

    def problem(self, parts, cfg):
        q, z, s = parts["qweight"], parts["qzeros"], parts["scales"]
        if q.dtype != torch.int32 or z.dtype != torch.int32:
            return f"qweight {q.dtype} / qzeros {z.dtype} are not GPTQ's int32 words"
        if s.shape[1] != q.shape[1] or z.shape != (s.shape[0], s.shape[1] // 8):
            return f"qweight {tuple(q.shape)}, qzeros {tuple(z.shape)} and scales {tuple(s.shape)} do not agree"
        return None

    def arguments(self, t, module, ck, parts, cfg, before):
        from ....models.quantized_checkpoint import gptq_zero_offset

        for s in ("qweight", "qzeros", "scales"):
            t.bind(f"{module}.{s}", [f"{ck}.{s}"])
        if "g_idx" in parts:
            t.bind(f"{module}.g_idx", [f"{ck}.g_idx"])
        else:
            t.bind(f"{module}.g_idx", [f"{ck}.qweight", f"{ck}.scales"], gptq_g_idx)
        nodes = [t.node(f"{module}.{s}", before) for s in ("qweight", "qzeros", "scales", "g_idx")]
        return [*nodes, gptq_zero_offset(cfg)], {}


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
    "awq_weight_for_op",
    "awq_offsets",
    "gptq_g_idx",
    "QuantizeFp8LinearFromConfig",
    "QuantizeFinegrainedFp8LinearFromConfig",
    "QuantizeNvfp4LinearFromConfig",
    "QuantizeInt4LinearFromConfig",
    "QuantizeInt4GptqLinearFromConfig",
]
