"""Tiny quantized checkpoints made here, from ``tiny:<arch>`` models: no downloads, fully seeded.

``save_tiny_quantized(arch, fmt, out_dir, seed=0)`` builds the random ``tiny:<arch>`` model, saves it
the way transformers does (``config.json`` + ``model.safetensors``, MoE experts per expert), then
replaces the linear weights with their quantized form in ``fmt`` and writes the quant config where
checkpoints of that kind keep it. ``load_model(out_dir)`` then loads it like any local directory
(``models.quantized_checkpoint``). The stored forms are the ones that module's table lists.

Per format (checkpoint names; ``m`` a linear module, ``x`` its calibration inputs):

* ``FP8``: per-tensor weight scale amax/448; ``input_scale`` = calibrated input amax / 448.
* ``FP8_BLOCK``: ``fp8_block_quantize`` with ``block`` (default 128 x 128; the 64-wide tiny matrices
  are then one partial tile each: pass e.g. ``block=(32, 32)`` for several).
* ``NVFP4``: ``nvfp4_quantize`` (global scale amax/(6*448)); ``input_scale`` = input amax/(6*448).
* ``W4A16_AWQ``: ModelOpt layout; ``pre_quant_scale`` p from the activations (AWQ's idea:
  ``p = 1 / sqrt(mean|x|)``, normalised), the stored weight is ``W / p`` quantized symmetrically
  (scale amax/7) in groups of ``group_size`` (default 32: the tiny K is 64/128).
* ``W4A16_GPTQ``: symmetric round-to-nearest in groups (zero point 8, stored as 7: classic format);
  ``desc_act=True`` quantizes the columns in decreasing activation order and records ``g_idx``.
* ``MXFP4``: MoE archs only, gpt-oss style: the stacked experts ``experts.gate_up_proj`` /
  ``down_proj`` as ``_blocks`` [E, N, K/32, 16] + ``_scales`` (``[E, out, in]`` order: gpt-oss's own
  ``[E, in, out]`` experts are transposed, its gate/up rows kept interleaved, its expert biases kept
  as they are); everything else stays fp32.

Stacked experts that a model multiplies with ``bmm`` (Llama-4's ``experts.gate_up_proj [E, H, 2I]`` /
``down_proj [E, I, H]``, saved stacked): in ``FP8`` each is stored float8_e4m3fn with one per-tensor
``<p>_weight_scale`` (amax/448) and ``<p>_input_scale`` (calibrated amax/448 of what that ``bmm``
reads: the score-scaled tokens, then ``up * act(gate)``) beside it, as ModelOpt's Llama-4 FP8
checkpoints have them; ``quantize_fp8_bmm_from_config`` reads them.

MoE experts (FP8, FP8_BLOCK, NVFP4) are quantized per expert like real per-expert checkpoints;
an expert's gate and up share their per-tensor scales (FP8 weight scale, NVFP4 global scale), as
ModelOpt does for projections that get fused, so stacking them into one ``w1_w3`` is exact. Input
scales of experts are upper bounds: every calibration token is run through every expert.

Excluded by default (kept fp32, listed in the config): ``lm_head`` and MoE routers (``*.mlp.gate``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F

from ..quantization.checkpoint_config import QuantConfig, write_quant_config

TINY_FORMATS = ("FP8", "FP8_BLOCK", "NVFP4", "MXFP4", "W4A16_AWQ", "W4A16_GPTQ")
DEFAULT_EXCLUDE = ("lm_head", "*.mlp.gate")
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_GATE, _UP = ("gate_proj", "w1"), ("up_proj", "w3")


def _calibrate(model: torch.nn.Module, vocab: int, tokens: int, seed: int):
    """Input amax and mean |x| per column of every nn.Linear, and the inputs of every experts module."""
    stats: Dict[str, Dict[str, Any]] = {}  # amax and mean_abs tensors, n an int
    expert_inputs: Dict[str, torch.Tensor] = {}
    hooks = []

    def linear_hook(name):
        def hook(_mod, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            s = stats.setdefault(name, {"amax": torch.zeros(()), "mean_abs": torch.zeros(x.shape[-1]), "n": 0})
            s["amax"] = torch.maximum(s["amax"], x.abs().amax())
            s["mean_abs"] = s["mean_abs"] + x.abs().sum(0)
            s["n"] += x.shape[0]

        return hook

    def experts_hook(name):
        def hook(_mod, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            expert_inputs[name] = torch.cat([expert_inputs[name], x]) if name in expert_inputs else x

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_hook(linear_hook(name)))
        elif name.endswith(".experts") and hasattr(mod, "gate_up_proj"):
            hooks.append(mod.register_forward_hook(experts_hook(name)))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (4, max(1, tokens // 4)), generator=g)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    for s in stats.values():
        s["mean_abs"] = s["mean_abs"] / max(1, s["n"])
    return stats, expert_inputs


def _hf_experts_name(prefix: str) -> str:
    """HF module name of a checkpoint experts prefix (Mixtral saves ``block_sparse_moe``)."""
    return prefix.replace(".block_sparse_moe.experts", ".mlp.experts")


def _experts_x(expert_inputs, prefix: str) -> torch.Tensor:
    return expert_inputs[_hf_experts_name(prefix)]


def _awq_pre_quant_scale(mean_abs: torch.Tensor) -> torch.Tensor:
    s = mean_abs.clamp(min=1e-4).sqrt()
    s = s / (s.max() * s.min()).sqrt()  # centred on 1 in log scale
    return 1.0 / s


def _quantize_linear(
    fmt: str,
    w: torch.Tensor,
    stat: Optional[dict],
    *,
    block,
    group: int,
    desc_act: bool,
    shared_amax: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """Stored tensors (by suffix) of one linear weight [N, K] in ``fmt``."""
    from ..ops.quant import codecs

    x_amax = stat["amax"] if stat is not None else None
    if fmt == "FP8":
        if shared_amax is not None:
            scale = (shared_amax / codecs.FP8_E4M3_MAX).float()
            w8 = codecs.to_fp8(w, scale)
        else:
            w8, scale = codecs.fp8_per_tensor_quantize(w)
        assert x_amax is not None  # the input scale needs the calibrated input amax
        return {
            "weight": w8,
            "weight_scale": scale.reshape(()),
            "input_scale": (x_amax / codecs.FP8_E4M3_MAX).float().reshape(()),
        }
    if fmt == "FP8_BLOCK":
        w8, scale_inv = codecs.fp8_block_quantize(w, block)
        return {"weight": w8, "weight_scale_inv": scale_inv}
    if fmt == "NVFP4":
        gs = None if shared_amax is None else (shared_amax / (codecs.E2M1_MAX * codecs.FP8_E4M3_MAX)).float()
        packed, block_scales, gs = codecs.nvfp4_quantize(w, gs, 16)
        assert x_amax is not None  # the input scale needs the calibrated input amax
        return {
            "weight": packed,
            "weight_scale": block_scales,
            "weight_scale_2": gs.reshape(()),
            "input_scale": (x_amax / (codecs.E2M1_MAX * codecs.FP8_E4M3_MAX)).float().reshape(()),
        }
    if fmt == "W4A16_AWQ":
        from ..quantization.weights import pack_int4_in_uint8

        assert stat is not None  # AWQ reads the calibrated inputs
        pqs = _awq_pre_quant_scale(stat["mean_abs"]).to(torch.float16)
        stored = w.float() / pqs.float()[None, :]
        _, scales, _ = codecs.int4_quantize_groups(stored, group, symmetric=True)
        scales = scales.to(torch.float16)
        return {"weight": pack_int4_in_uint8(stored, scales.float()), "weight_scale": scales, "pre_quant_scale": pqs}
    if fmt == "W4A16_GPTQ":
        k = w.shape[1]
        perm = torch.argsort(cast(dict, stat)["mean_abs"], descending=True) if desc_act else torch.arange(k)
        codes_p, scales, _ = codecs.int4_quantize_groups(w.float()[:, perm], group, symmetric=True)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(k)
        codes = codes_p[:, inv]  # back in column order
        g_idx = (inv // group).to(torch.int32)  # column k sits at position inv[k] of the order
        zeros = torch.full((k // group, w.shape[0]), 8 - 1, dtype=torch.uint8)  # zero point 8, stored minus one
        return {
            "qweight": codecs.gptq_pack_rows(codes.t().contiguous()),
            "qzeros": codecs.gptq_pack_cols(zeros),
            "scales": scales.t().contiguous().to(torch.float16),
            "g_idx": g_idx,
        }
    raise ValueError(f"no linear quantization for {fmt!r}")


def _expert_groups(names: Iterable[str]) -> Dict[str, Dict[int, Dict[str, str]]]:
    """prefix -> expert -> projection -> checkpoint tensor name."""
    out: Dict[str, Dict[int, Dict[str, str]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            out.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
    return out


def _quantize_experts(
    fmt: str, tensors: Dict[str, torch.Tensor], expert_inputs, *, block, group
) -> Dict[str, torch.Tensor]:
    """Quantized per-expert tensors (FP8 / FP8_BLOCK / NVFP4), gate and up sharing per-tensor scales."""
    out: Dict[str, torch.Tensor] = {}
    for prefix, experts in _expert_groups(tensors).items():
        x = _experts_x(expert_inputs, prefix)
        for _, projs in sorted(experts.items()):
            gate_name = next(projs[p] for p in _GATE if p in projs)
            up_name = next(projs[p] for p in _UP if p in projs)
            down_name = next(n for p, n in projs.items() if p not in _GATE + _UP)
            g, u, d = tensors[gate_name], tensors[up_name], tensors[down_name]
            h = F.silu(x @ g.t()) * (x @ u.t())  # what the down projection sees, from every token
            shared = torch.maximum(g.abs().amax(), u.abs().amax())
            x_stat, h_stat = {"amax": x.abs().amax()}, {"amax": h.abs().amax()}
            for name, w, stat, amax in (
                (gate_name, g, x_stat, shared),
                (up_name, u, x_stat, shared),
                (down_name, d, h_stat, None),
            ):
                module = name[: -len(".weight")]
                for suffix, t in _quantize_linear(
                    fmt, w, stat, block=block, group=group, desc_act=False, shared_amax=amax
                ).items():
                    out[f"{module}.{suffix}"] = t
    return out


def _fp8_bmm_experts(
    model: torch.nn.Module, tensors: Dict[str, torch.Tensor], expert_inputs
) -> Dict[str, torch.Tensor]:
    """FP8 stacked BMM experts (Llama-4 style, see the module docstring): checkpoint name -> tensor,
    for every experts module saved stacked whose forward is ``bmm(x [E, T, H], gate_up_proj [E, H, 2I])``
    then ``bmm(up * act(gate), down_proj [E, I, H])`` (not transformers' experts interface)."""
    from ..ops.quant import codecs

    out: Dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if hasattr(m, "_is_expert_parallel") or name not in expert_inputs:
            continue  # transformers' experts interface (grouped/batched GEMMs), or never called
        w13_name, w2_name = f"{name}.gate_up_proj", f"{name}.down_proj"
        if w13_name not in tensors or w2_name not in tensors or not hasattr(m, "act_fn"):
            continue
        w13, w2 = tensors[w13_name].float(), tensors[w2_name].float()
        n_exp, hidden = w13.shape[0], w13.shape[1]
        if w13.dim() != 3 or w2.shape != (n_exp, w13.shape[2] // 2, hidden):
            continue
        x = expert_inputs[name].reshape(n_exp, -1, hidden)  # every expert's (score-scaled) tokens
        gate, up = torch.bmm(x, w13).chunk(2, dim=-1)
        h = up * m.act_fn(gate)
        for wname, w, inp in ((w13_name, w13, x), (w2_name, w2, h)):
            w8, scale = codecs.fp8_per_tensor_quantize(w)
            out[wname] = w8
            out[wname + "_weight_scale"] = scale.float().reshape(())
            out[wname + "_input_scale"] = (inp.abs().amax() / codecs.FP8_E4M3_MAX).float().reshape(())
    return out


def _mxfp4_experts(model: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], set]:
    """Stacked experts of the HF model as MXFP4 ``_blocks`` / ``_scales``; the checkpoint names they replace.

    Blocks are always stored ``[E, out, in/32, 16]`` (32 inputs per scale, as gpt-oss's checkpoints and
    transformers' ``convert_moe_packed_tensors`` have them). Experts that transformers keeps
    ``[E, in, out]`` (``is_transposed``: gpt-oss's ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``)
    are transposed first, so their gate/up rows stay interleaved as the model reads them. Expert
    biases (gpt-oss) stay unquantized, as in the real checkpoints."""
    from ..ops.quant import codecs

    out: Dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = p.detach().float()
            if getattr(modules[name.rsplit(".", 1)[0]], "is_transposed", False):
                w = w.transpose(-1, -2)
            packed, scales = codecs.mxfp4_quantize(w.contiguous(), 32)
            out[name + "_blocks"] = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 16, 16)
            out[name + "_scales"] = scales
    if not out:
        raise ValueError(
            "MXFP4 checkpoints here quantize stacked MoE experts; this model has none "
            "(use a MoE arch: tiny:gpt_oss, tiny:qwen3_moe or tiny:mixtral)"
        )
    replaced = {n for group in _expert_groups(tensors).values() for e in group.values() for n in e.values()}
    # saved stacked (no per-expert conversion in transformers, e.g. gpt-oss): the fp32 copy goes too
    replaced |= {n[: -len("_blocks")] for n in out if n.endswith("_blocks") and n[: -len("_blocks")] in tensors}
    return out, replaced


def save_tiny_quantized(
    arch: str,
    fmt: str,
    out_dir: Union[str, Path],
    seed: int = 0,
    *,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    group_size: int = 32,
    block: Tuple[int, int] = (128, 128),
    desc_act: bool = False,
    calib_tokens: int = 64,
) -> Path:
    """Save ``tiny:<arch>`` (random, ``seed``) quantized in ``fmt`` to ``out_dir``; returns ``out_dir``.

    ``exclude``: module patterns kept unquantized (recorded in the config); ``group_size``: AWQ/GPTQ
    groups; ``block``: FP8_BLOCK tile; ``desc_act``: GPTQ act-order. See the module docstring.
    """
    from safetensors.torch import load_file, save_file

    from .factory import load_model

    if fmt not in TINY_FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(TINY_FORMATS)}, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(f"tiny:{arch}", seed=seed)
    model = loaded.model
    model.save_pretrained(out)  # type: ignore[operator]  # nn.Module's __getattr__ stub; config.json + the checkpoint's own tensor names (experts per expert)
    weights_file = out / "model.safetensors"
    tensors = load_file(str(weights_file))
    int4 = fmt in ("W4A16_AWQ", "W4A16_GPTQ")
    cfg = QuantConfig(
        fmt,
        group_size=group_size if int4 else {"NVFP4": 16, "MXFP4": 32}.get(fmt),
        weight_block_size=cast(Tuple[int, int], tuple(block)) if fmt == "FP8_BLOCK" else None,
        exclude_modules=tuple(exclude),
        sym=True if int4 else None,
        desc_act=desc_act if fmt == "W4A16_GPTQ" else None,
    )
    stats, expert_inputs = _calibrate(model, loaded.config.vocab_size, calib_tokens, seed)
    new: Dict[str, torch.Tensor] = {}
    if fmt == "MXFP4":
        new, replaced = _mxfp4_experts(model, tensors)
        for name in replaced:
            del tensors[name]
        tensors.update(new)
        cfg = QuantConfig("MXFP4", group_size=32, exclude_modules=tuple(exclude) + ("*.self_attn",))
    else:
        linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for name in list(tensors):
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is None or module not in linears or cfg.is_excluded(module):
                continue
            quantized = _quantize_linear(
                fmt, tensors.pop(name), stats.get(module), block=block, group=group_size, desc_act=desc_act
            )
            tensors.update({f"{module}.{suffix}": t for suffix, t in quantized.items()})
        experts = {n: t for n, t in tensors.items() if _EXPERT.match(n) and not cfg.is_excluded(n[: -len(".weight")])}
        if experts:
            if fmt not in ("FP8", "FP8_BLOCK", "NVFP4"):
                raise ValueError(
                    f"{fmt} MoE experts are not made here (FP8, FP8_BLOCK and NVFP4 are; MXFP4 for stacked experts)"
                )
            for name in experts:
                del tensors[name]
            tensors.update(_quantize_experts(fmt, experts, expert_inputs, block=block, group=group_size))
        if fmt == "FP8":
            tensors.update(_fp8_bmm_experts(model, tensors, expert_inputs))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights_file), metadata={"format": "pt"})
    write_quant_config(out, cfg)
    return out


__all__ = ["save_tiny_quantized", "TINY_FORMATS", "DEFAULT_EXCLUDE"]
