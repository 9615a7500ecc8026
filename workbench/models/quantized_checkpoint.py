"""A quantized checkpoint directory as two things: the dequantized twin and the raw quantized tensors.

``load_quantized_dir(directory, quant_config)`` reads every safetensors file once and splits it:

* the **dequantized twin**: the HF model built from ``config.json`` *without* transformers' own
  quantizer (``quantization_config`` is stripped), filled with every quantized weight dequantized
  (``workbench.ops.quant.codecs``) in the requested dtype. It is the eager model of the pipeline:
  the numerics reference, and what a graph binds to where no quantize transform ran.
* a ``QuantizedCheckpoint``: the quant config and the raw tensors of the quantized modules (weights
  and their scales, exactly as stored, by checkpoint name). The quantize transforms give the graph
  tensors of these names and declare how each is bound at load (``pipeline.weights.TensorBinding``).

Stored forms read here (per module ``m``, checkpoint names):

=================  ======================================================================================
FP8                ``m.weight`` float8_e4m3fn [N, K], ``m.weight_scale`` / ``m.input_scale`` fp32 (one element);
                   a bare parameter ``p`` (Llama-4's stacked BMM experts) ``p_weight_scale`` / ``p_input_scale``
FP8_BLOCK          ``m.weight`` float8_e4m3fn [N, K], ``m.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]
NVFP4              ``m.weight`` uint8 [N, K/2], ``m.weight_scale`` fp8 [N, K/16], ``m.weight_scale_2``,
                   ``m.input_scale`` fp32 (one element each)
W4A16_AWQ          ModelOpt: ``m.weight`` uint8 [N/2, K] (signed int4, output rows 2r / 2r+1 in the low /
                   high nibble), ``m.weight_scale`` [N, K/g], optional ``m.pre_quant_scale`` [K]
                   (``y = (x * pre_quant_scale) @ W'.T``: the twin's weight is ``W' * pre_quant_scale``)
W4A16_GPTQ         ``m.qweight`` int32 [K/8, N], ``m.qzeros`` int32 [G, N/8], ``m.scales`` [G, N],
                   optional ``m.g_idx`` [K]; zero points stored minus one unless
                   ``checkpoint_format: gptq_v2``
MXFP4              ``p_blocks`` uint8 [..., N, K/32, 16] and ``p_scales`` uint8 e8m0 [..., N, K/32] for a
                   parameter ``p`` (gpt-oss: stacked experts ``experts.gate_up_proj`` [E, 2I, H])
=================  ======================================================================================

MoE experts are stored per expert (``...experts.<e>.gate_proj.weight``, as transformers saves them);
transformers itself stacks the dequantized ones into the twin's ``experts.gate_up_proj``, and the
MoE quantize transforms stack the raw ones (``expert_modules`` finds them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from ..quantization.checkpoint_config import QuantConfig

logger = logging.getLogger("workbench.models")

# Suffixes of a quantized module's tensors besides ``weight`` (kept raw, dropped from the twin).
QUANT_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "input_scale",
    "pre_quant_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "k_scale",
    "v_scale",
    "output_scale",
)
GRAPH_PREFIX = "model."  # export_contract.CausalLMLogits keeps the HF model as ``.model``
# (gate, up, down) projection names of stacked experts in checkpoints: HF/Qwen and Mixtral spellings.
EXPERT_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertModules:
    """Checkpoint module names of one MoE block's experts, per expert: gate, up, down."""

    gate: Tuple[str, ...]
    up: Tuple[str, ...]
    down: Tuple[str, ...]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A quantized checkpoint: its ``QuantConfig`` and its raw quantized tensors by checkpoint name."""

    config: QuantConfig
    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    directory: Optional[Path] = None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def module(self, name: str) -> Dict[str, torch.Tensor]:
        """The raw tensors of checkpoint module ``name`` by suffix (``weight``, ``weight_scale``...)."""
        prefix = name + "."
        return {
            k[len(prefix) :]: t for k, t in self.tensors.items() if k.startswith(prefix) and "." not in k[len(prefix) :]
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @staticmethod
    def checkpoint_name(graph_target: str) -> str:
        """The checkpoint name of a graph attribute (``model.model.layers.0...`` -> ``model.layers.0...``)."""
        return graph_target[len(GRAPH_PREFIX) :] if graph_target.startswith(GRAPH_PREFIX) else graph_target

    def expert_modules(self, stacked_module: str, num_experts: int) -> Optional[ExpertModules]:
        """Per-expert checkpoint modules behind the graph's stacked experts module (checkpoint naming,
        e.g. ``model.layers.0.mlp.experts``), or None when the checkpoint stores none of them.
        Mixtral checkpoints spell the block ``block_sparse_moe`` and the projections w1/w3/w2."""
        prefixes = [stacked_module]
        if ".mlp.experts" in stacked_module:
            prefixes.append(stacked_module.replace(".mlp.experts", ".block_sparse_moe.experts"))
        for prefix in prefixes:
            for gate, up, down in EXPERT_PROJECTIONS:
                if f"{prefix}.0.{gate}.weight" in self.tensors or f"{prefix}.0.{gate}.qweight" in self.tensors:
                    names = [tuple(f"{prefix}.{e}.{p}" for e in range(num_experts)) for p in (gate, up, down)]
                    return ExpertModules(*names)
        return None


# ----------------------------------------------------------------------------------- dequantize
def bmm_scale_names(weight: str) -> Tuple[str, str]:
    """(weight_scale, input_scale) checkpoint names of a bmm weight: ``m.weight`` -> ``m.weight_scale``,
    a bare parameter ``p`` (stacked experts, say) -> ``p_weight_scale``."""
    stem = weight[: -len("weight")] if weight.endswith(".weight") else weight + "_"
    return stem + "weight_scale", stem + "input_scale"


def gptq_zero_offset(cfg: QuantConfig) -> int:
    """1 for classic GPTQ storage (zero points stored minus one), 0 for ``checkpoint_format: gptq_v2``."""
    return 0 if str(cfg.raw.get("checkpoint_format", "gptq")).lower() == "gptq_v2" else 1


def _one_scale(t: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale stored as [] or [1] -> fp32 0-d; per-row [N] / [N, 1] -> [N, 1]."""
    t = t.float()
    return t.reshape(()) if t.numel() == 1 else t.reshape(-1, 1)


def dequantize_module(parts: Mapping[str, torch.Tensor], cfg: QuantConfig, name: str) -> Optional[torch.Tensor]:
    """The fp32 weight [N, K] of quantized module ``name`` from its raw tensors (by suffix), or None
    when the module is not quantized (a plain float ``weight``)."""
    from ..ops.quant import codecs

    w = parts.get("weight")
    if "qweight" in parts:
        if cfg.quant_algo != "W4A16_GPTQ":
            raise NotImplementedError(
                f"{name}: qweight/qzeros storage under {cfg.quant_algo} ({cfg.source}) is not supported here: "
                "AutoAWQ GEMM packing is not read yet (ModelOpt W4A16_AWQ and GPTQ checkpoints are)"
            )
        qweight, scales = parts["qweight"], parts["scales"]
        g_idx = parts.get("g_idx")
        if g_idx is None:
            k = qweight.shape[0] * 8
            g_idx = codecs.gptq_default_g_idx(k, k // scales.shape[0])
        return codecs.gptq_dequantize(qweight, parts["qzeros"], scales, g_idx, gptq_zero_offset(cfg))
    if w is None:
        return None
    if w.dtype == torch.float8_e4m3fn:
        if "weight_scale_inv" in parts:
            block = cfg.weight_block_size or (128, 128)
            return codecs.fp8_block_dequantize(w, parts["weight_scale_inv"], block)
        if "weight_scale" in parts:
            return w.float() * _one_scale(parts["weight_scale"])
        raise ValueError(f"{name}: an fp8 weight without weight_scale or weight_scale_inv cannot be dequantized")
    if w.dtype == torch.uint8 and "weight_scale" in parts:
        scale = parts["weight_scale"]
        if scale.dtype == torch.float8_e4m3fn:  # NVFP4
            if "weight_scale_2" not in parts:
                raise ValueError(f"{name}: an NVFP4 weight needs weight_scale_2 (its global scale)")
            return codecs.nvfp4_dequantize(w, scale, parts["weight_scale_2"].float().reshape(()), cfg.block_size or 16)
        from ..quantization.weights import unpack_int4_from_uint8  # ModelOpt's int4 packing

        codes = unpack_int4_from_uint8(w).float()  # [N, K] signed
        dense = codes * scale.float().repeat_interleave(codes.shape[-1] // scale.shape[-1], dim=-1)
        pqs = parts.get("pre_quant_scale")
        return dense * pqs.float().reshape(1, -1) if pqs is not None else dense
    if w.is_floating_point():
        return None
    raise ValueError(
        f"{name}: weight of dtype {w.dtype} with tensors {sorted(parts)} is no format this loader reads "
        f"({cfg.quant_algo}, from {cfg.source})"
    )


def split_checkpoint(
    tensors: Mapping[str, torch.Tensor], cfg: QuantConfig, dtype: torch.dtype
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(dense state dict for the twin in ``dtype``, raw tensors of the quantized modules), both by
    checkpoint name."""
    from ..ops.quant import codecs

    dense: Dict[str, torch.Tensor] = {}
    raw: Dict[str, torch.Tensor] = {}
    modules: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        if leaf.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:  # MXFP4 parameter
            scales = tensors[name[: -len("_blocks")] + "_scales"]
            blocks = t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])
            dense[name[: -len("_blocks")]] = codecs.mxfp4_dequantize(blocks, scales).to(dtype)
            raw[name], raw[name[: -len("_blocks")] + "_scales"] = t, scales
        elif leaf.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors:
            continue
        elif t.dtype == torch.float8_e4m3fn and name + "_weight_scale" in tensors:  # bare FP8 parameter
            dense[name] = (t.float() * tensors[name + "_weight_scale"].float()).to(dtype)  # (Llama-4 experts)
            raw[name] = t
        elif leaf.endswith(("_weight_scale", "_input_scale")) and name.rsplit("_", 2)[0] in tensors:
            raw[name] = t
        elif leaf in ("weight", *QUANT_SUFFIXES):
            modules.setdefault(owner, {})[leaf] = t
        else:
            dense[name] = t.to(dtype) if t.is_floating_point() else t
    for owner, parts in modules.items():
        weight = dequantize_module(parts, cfg, owner)
        if weight is None:  # an unquantized module (excluded, or never quantized)
            for leaf, t in parts.items():
                (dense if leaf == "weight" else raw)[f"{owner}.{leaf}"] = t.to(dtype) if leaf == "weight" else t
            continue
        dense[f"{owner}.weight"] = weight.to(dtype)
        for leaf, t in parts.items():
            raw[f"{owner}.{leaf}"] = t
    return dense, raw


# ----------------------------------------------------------------------------------------- load
def read_safetensors(directory: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: a quantized checkpoint needs its weights as .safetensors files; none found")
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f), device="cpu"))
    return out


def _causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"no causal-LM class for model_type {config.model_type!r} in this transformers") from None


def strip_quantization_config(config) -> None:
    """Drop ``quantization_config`` so transformers builds plain modules (no quantizer of its own)."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")


def orient_transposed_experts(config, dense: Dict[str, torch.Tensor], mxfp4_params: List[str]) -> None:
    """MXFP4 ``_blocks`` store stacked experts ``[E, out, in]``; transformers keeps some experts
    ``[E, in, out]`` (``is_transposed``: gpt-oss's ``gate_up_proj [E, H, 2I]``) and transposes them
    when it dequantizes (``convert_moe_packed_tensors``). The twin's dequantized tensors get the same
    turn, read from the modules of a weightless (meta) build of the model."""
    if not mxfp4_params:
        return
    with torch.device("meta"):
        skeleton = _causal_lm_class(config)._from_config(config)
    modules = dict(skeleton.named_modules())
    for name in mxfp4_params:
        if getattr(modules.get(name.rpartition(".")[0]), "is_transposed", False):
            dense[name] = dense[name].transpose(-1, -2).contiguous()


def load_quantized_dir(
    directory: Path, quant_config: QuantConfig, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.nn.Module, QuantizedCheckpoint]:
    """(dequantized twin in ``dtype`` on ``device``, raw checkpoint) of a quantized checkpoint dir."""
    from transformers import AutoConfig

    directory = Path(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    strip_quantization_config(config)
    dense, raw = split_checkpoint(read_safetensors(directory), quant_config, dtype)
    orient_transposed_experts(config, dense, [n[: -len("_blocks")] for n in raw if n.endswith("_blocks")])
    if not raw:
        raise ValueError(
            f"{directory}: {quant_config.source} says {quant_config.quant_algo}, but no tensor in the "
            "safetensors files is stored quantized"
        )
    placement = {} if device.type == "cpu" else {"device_map": {"": str(device)}}
    model, info = _causal_lm_class(config).from_pretrained(
        None, config=config, state_dict=dense, dtype=dtype, output_loading_info=True, **placement
    )
    missing: List[str] = list(info.get("missing_keys", []))
    if missing:
        raise ValueError(f"{directory}: the checkpoint has no tensor for {missing[:5]} ({len(missing)} in all)")
    unexpected = list(info.get("unexpected_keys", []))
    if unexpected:
        logger.warning("%s: tensors not used by the model: %s", directory.name, unexpected[:5])
    return model, QuantizedCheckpoint(config=quant_config, tensors=raw, directory=directory)


__all__ = [
    "QuantizedCheckpoint",
    "ExpertModules",
    "load_quantized_dir",
    "split_checkpoint",
    "orient_transposed_experts",
    "dequantize_module",
    "read_safetensors",
    "gptq_zero_offset",
    "bmm_scale_names",
    "QUANT_SUFFIXES",
    "GRAPH_PREFIX",
]
