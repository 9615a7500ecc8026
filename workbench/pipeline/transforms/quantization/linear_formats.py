"""How each checkpoint format's linear becomes its quantized op: ``LinearFormat`` and one subclass per
format (``FP8Linear``, ``FineGrainedFP8Linear``, ``NVFP4Linear``, ``AWQLinear``, ``GPTQLinear``), with
the declared conversions ``load_weights`` runs. ``linear.py``'s transforms pick the format.

A format says which checkpoint tensors a module must hold (``required``), why a module's tensors do
not fit the op (``problem``), and binds the op's graph tensors to checkpoint names (``arguments``);
FP8, fine-grained FP8 and NVFP4 can also quantize a full-precision weight at load (``from_model``).

Scales stored as [1] are bound as 0-d fp32. AWQ: ModelOpt packs signed int4 codes of two *output*
rows per byte ([N/2, K]); ``torch_int4_awq_linear`` reads ``torch_int4_linear``'s packing along K
([N, K/2], codes + 8, offsets = -8 * scale): ``awq_weight_for_op`` / ``awq_offsets`` are the
declared conversions, run by ``load_weights``. GPTQ checkpoints without ``g_idx`` get the default
one (``gptq_g_idx``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.quant import codecs
from ....ops.quant.codecs import gptq_default_g_idx
from ....ops.quant.int4 import RUN, pack_int4
from .graph import GraphTensors, scalar_fp32

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


__all__ = [
    "LinearFormat",
    "FP8Linear",
    "FineGrainedFP8Linear",
    "NVFP4Linear",
    "AWQLinear",
    "GPTQLinear",
    "awq_weight_for_op",
    "awq_offsets",
    "gptq_g_idx",
    "unit_scale",
]
