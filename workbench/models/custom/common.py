"""What the custom canonical-op models share: the export contract, RoPE tables, the SwiGLU MLP, the
stacked routed experts and the embedding -> layers -> norm -> lm_head skeleton.

Each ``modeling_<name>.py`` keeps what is particular to its architecture (attention, router, norms,
the decoder layer); what is the same logic lives here once so a fix to the contract check or the RoPE
schedule reaches every custom model. Module attribute names (``embed_tokens``, ``layers``, ``norm``,
``rotary_emb``, ``lm_head``, ``gate_proj``...) are HF's, so checkpoints load strictly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

import workbench.ops  # noqa: F401  (registers torch.ops.workbench)

OPS = torch.ops.workbench
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # inv_freq independent of the sequence length


@dataclass
class CausalLMOutput:
    """What the export contract reads (``models/export_contract.CausalLMLogits``: ``.logits``)."""

    logits: torch.Tensor  # [b, s, vocab]


def rope_parameters(config) -> dict:
    """The config's ``rope_parameters`` (a copy), with ``rope_type`` defaulting to ``"default"``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    return params


def rope_inverse_frequencies(config, dim: int, model_name: str) -> Tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_scaling) for the rotary part of ``dim`` channels.

    The plain schedule is computed here; scaled schedules (linear, YaRN, Llama-3) come from
    transformers' own ``ROPE_INIT_FUNCTIONS`` so they cannot drift from the checkpoint's reference.
    Length-dependent schedules (dynamic NTK, LongRoPE) would make the graph depend on the sequence
    length and are refused (``model_name`` names the custom class in that error).
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"custom {model_name}: rope_type {rope_type!r} rescales with the sequence length; supported: "
            f"{STATIC_ROPE_TYPES}. Load with custom_models=False to export HF's own class"
        )
    if rope_type == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.to(torch.float32), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin ``[b, s, rotary dim]`` for the given positions, computed once per forward for all layers.
    ``inv_freq`` is a non-persistent buffer, as in HF (not in the checkpoint)."""

    inv_freq: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.attention_scaling = attention_scaling
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].to(torch.float32) * self.inv_freq.to(torch.float32)  # [b, s, dr/2]
        angles = torch.cat((angles, angles), dim=-1)  # [b, s, dr]
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` as ``torch_swiglu_mlp`` (dense layers and shared experts)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.torch_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class RMSNorm(nn.Module):
    """``torch_rmsnorm``: weight * normalised x (statistics in fp32): HF's Llama / Qwen3 / DeepSeek-V3 RMSNorm."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.torch_rmsnorm(x, self.weight, self.eps)


class TopKSoftmaxRouter(nn.Module):
    """Router logits ``x W^T`` -> ``torch_moe_topk_softmax`` (softmax in fp32, top-k, renormalised when
    ``norm_topk_prob``): [T, H] -> (weights [T, k] cast back to the logits' dtype, as HF does,
    expert ids [T, k]). Replicated on every rank in the sharding IR models."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight)  # [T, E]
        weights, expert_ids = OPS.torch_moe_topk_softmax(logits, self.top_k, self.norm_topk_prob)
        return weights.to(logits.dtype), expert_ids


class StackedExperts(nn.Module):
    """The routed experts as stacked tensors (HF transformers >= 5 layout): ``gate_up_proj [E, 2I, H]``
    (gate rows first), ``down_proj [E, H, I]``; combined by ``torch_moe_fused``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] -> [T, H] in x's dtype."""
        return OPS.torch_moe_fused(x, expert_ids, weights, self.gate_up_proj, self.down_proj, act_fn="silu")


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm: (input_ids, position_ids) [b, s] -> hidden [b, s, H].

    RoPE cos/sin (over the first ``rotary_dim`` channels of a head) are computed once from the
    positions and handed to every layer; a layer that does not rotate ignores them.
    ``make_layer(config, i)`` and ``make_norm(size, eps)`` build the architecture's own decoder
    layers and norm; ``model_name`` names the custom class in the errors it raises."""

    def __init__(
        self,
        config,
        make_layer: Callable[[Any, int], nn.Module],
        make_norm: Callable[[int, float], nn.Module],
        rotary_dim: int,
        model_name: str,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(*rope_inverse_frequencies(config, rotary_dim, model_name))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


def check_silu(config, model_name: str, silu_users: str) -> None:
    """Refuse a ``hidden_act`` other than silu: ``silu_users`` names what computes silu only (the
    message's "<silu_users> silu", e.g. ``"the hinted MLP uses"``); ``model_name`` names the custom class."""
    if config.hidden_act != "silu":
        raise NotImplementedError(
            f"custom {model_name}: hidden_act={config.hidden_act!r}; {silu_users} silu. "
            "Load with custom_models=False to export HF's own class"
        )


def check_export_contract(position_ids: Optional[torch.Tensor], unused: dict) -> None:
    """The contract is ``(input_ids, position_ids)``: positions are required (no fallback to arange),
    and HF runtime arguments that would change the result (a mask, a cache) are refused."""
    if position_ids is None:
        raise ValueError(
            "position_ids is required (the export contract passes them explicitly; there is no fallback to 0..s-1)"
        )
    live = {k: v for k, v in unused.items() if v is not None and v is not False}
    if live:
        raise ValueError(
            f"this prefill-only custom model takes (input_ids, position_ids) only: got {sorted(live)}. "
            "Masks and caches are added by the pipeline's cache stage, not passed to the model"
        )


class CustomCausalLM(nn.Module):
    """A decoder stack (``model``) plus ``lm_head`` (tied to the embedding when the config says so):
    ``forward(input_ids, position_ids)`` -> ``CausalLMOutput``, the export contract checked first.

    A subclass names its ``decoder_class`` (built as ``decoder_class(config)``) and ``check_config``,
    which refuses configs the rewrite does not implement before anything is built."""

    decoder_class: Callable[[Any], DecoderStack]
    check_config: Callable[[Any], None]

    def __init__(self, config):
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = self.decoder_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, **unused: Any
    ) -> CausalLMOutput:
        check_export_contract(position_ids, unused)
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids, position_ids)))
