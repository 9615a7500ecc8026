"""Shared pieces of the custom-model tests (``test_custom_*.py``): unit-gain random weights, the HF /
custom pair on the same weights, and the op-histogram check of an exported graph."""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch

from workbench.models.build import build_random_model, cast_parameters
from workbench.models.custom import CUSTOM_MODELS
from workbench.models.tiny import TINY_ARCHS
from workbench.models.tiny_families.custom import ARCHS as CUSTOM_TINY_ARCHS

#: tiny:<arch> names of the default registry plus tiny:deepseek_v3 (tiny_families/custom.py: not
#: merged into TINY_ARCHS yet).
TINY_REGISTRY = {**TINY_ARCHS, **CUSTOM_TINY_ARCHS}

# aten ops that would mean a mechanism was spelled out instead of going through its canonical op:
# attention (SDPA, softmax-matmul chains), RMSNorm chains, per-expert routing loops / grouped GEMMs,
# the conv and the chunked delta-rule recurrence.
FORBIDDEN_ATEN = (
    "scaled_dot_product_attention", "_softmax", "softmax", "matmul", "bmm", "baddbmm",
    "rsqrt", "pow", "mean",
    "index_add", "index_add_", "nonzero", "one_hot", "where", "histc", "bincount", "_grouped_mm", "sort", "argsort",
    "cumsum", "convolution", "conv1d", "tril", "triu",
)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Unit-gain random weights, in place: every matrix ``N(0, fan_in**-1)`` (so each block's output is
    O(1) and a wrong computation cannot hide under HF's 0.02-std init, where the layers barely move
    the residual stream), vectors (norm weights, biases, dt_bias) perturbed by 0.1 noise, Mamba-style
    ``A_log = log U(1, 16)``, DeepSeek's ``e_score_correction_bias`` 0.1 noise (so it changes routing)."""
    gen = torch.Generator().manual_seed(seed)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen).to(t.dtype)

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
        elif p.dim() >= 2:
            p.copy_(noise(p) * p.shape[-1] ** -0.5)
        else:
            p.add_(0.1 * noise(p))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * noise(b))
    return model


def hf_and_custom(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_changes):
    """(HF model, custom model, config) for ``tiny:<arch>`` with ``config_changes``: the HF model built
    from its own class with unit-gain weights, the custom model built from the same config and loaded
    with the HF state dict *strictly* (``load_state_dict`` raises on any missing or unexpected key)."""
    config = TINY_REGISTRY[arch]()
    config._attn_implementation = "sdpa"
    for key, value in config_changes.items():
        setattr(config, key, value)
    hf = randomize(build_random_model(config, torch.float32, "cpu", seed), seed).eval()
    custom = CUSTOM_MODELS[type(config).__name__](config).eval()
    custom.load_state_dict(hf.state_dict(), strict=True)
    if dtype != torch.float32:  # as load_model does: parameters cast, buffers (RoPE, router bias) kept fp32
        cast_parameters(hf, dtype)
        cast_parameters(custom, dtype)
    return hf, custom, config


def workbench_ops(hist: Mapping[str, int]) -> Dict[str, int]:
    """``{op name: count}`` of the ``workbench::`` ops in an op histogram."""
    return {k.split(".")[1]: v for k, v in hist.items() if k.startswith("workbench.")}


def spelled_out(hist: Mapping[str, int]) -> Dict[str, int]:
    """The FORBIDDEN_ATEN ops present in an op histogram (``aten.<op>.<overload>`` keys)."""
    return {k: v for k, v in hist.items() if k.startswith("aten.") and k.split(".")[1] in FORBIDDEN_ATEN}


def probe_inputs(vocab: int, batch: int, seq: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids, torch.arange(seq).expand(batch, seq)
