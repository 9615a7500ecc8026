"""A small DeltaNet causal LM in HF form: the family behind the plain (ungated) delta rule.

No transformers family uses the ungated delta rule (Qwen3-Next, Qwen3.5 and OLMo-hybrid gate it, and
Kimi Linear's KDA gates it per channel), so ``tiny:deltanet`` is this model: a ``PretrainedConfig`` +
``PreTrainedModel`` pair with ``GenerationMixin``, built like every tiny arch through
``AutoModelForCausalLM.from_config`` and initialised by ``_init_weights``::

    embed -> N x [ RMSNorm -> DeltaNetMixer -> +residual -> RMSNorm -> SwiGLU MLP -> +residual ] -> RMSNorm -> lm_head
    DeltaNetMixer: qkv_proj -> causal depthwise conv (k=4) + silu -> split q, k, v per head
                   -> L2-normalise q, k -> delta rule (beta = sigmoid(beta_proj(x))) -> out_proj

Its eager forward is the plain token-by-token recurrence (``_recurrent_delta_rule`` below, written
independently of ``workbench.ops``), so the pipeline's numerics probe and the greedy-token tests
compare the canonical ops against a separate spelling. The model keeps no cache: ``use_cache`` is
False in its config, so HF ``generate`` re-runs the whole sequence every step -- slow, but the
plainest possible reference for the cached runtime.

Registration: ``register_deltanet()`` adds the config/model pair to transformers' Auto mappings
(``AutoConfig.register`` / ``AutoModelForCausalLM.register``, idempotent). It is called by the
``tiny:deltanet`` builder, not at import, so importing workbench changes nothing in transformers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

MODEL_TYPE = "workbench_deltanet"  # prefixed: never collides with a model type transformers may add
L2NORM_EPS = 1e-6  # FLA's q/k normalisation eps (the ops' use_qk_l2norm uses the same)


class DeltaNetConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_heads: int = 4,
        head_k_dim: int = 16,
        head_v_dim: int = 16,
        conv_kernel_size: int = 4,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 512,
        use_cache: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings  # no positional encoding; a length budget
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class DeltaNetRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """q/k [b, s, h, dk] (normalised, q scaled), v [b, s, h, dv], beta [b, s, h], fp32 -> [b, s, h, dv]."""
    b, s, h, dk = k.shape
    state = v.new_zeros(b, h, dk, v.shape[-1])  # S: maps a key to its value, per head
    out = []
    for t in range(s):
        k_t, v_t = k[:, t], v[:, t]
        err = v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)  # what the state gets wrong for k_t
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, t, :, None] * err)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, dim=1)


class DeltaNetMixer(nn.Module):
    def __init__(self, config: DeltaNetConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_k_dim, self.head_v_dim = (config.num_heads, config.head_k_dim, config.head_v_dim)
        channels = config.num_heads * (2 * config.head_k_dim + config.head_v_dim)
        self.qkv_proj = nn.Linear(config.hidden_size, channels, bias=False)
        self.conv1d = nn.Conv1d(
            channels,
            channels,
            config.conv_kernel_size,
            groups=channels,
            bias=False,
            padding=config.conv_kernel_size - 1,
        )
        self.beta_proj = nn.Linear(config.hidden_size, config.num_heads, bias=False)
        self.out_proj = nn.Linear(config.num_heads * config.head_v_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if attention_mask is not None and attention_mask.dim() == 2:  # padded tokens must not enter the state
            hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
        s = hidden_states.shape[1]
        # nn.Conv1d pads k-1 on both sides: the first s outputs are the causal ones
        qkv = F.silu(self.conv1d(self.qkv_proj(hidden_states).transpose(1, 2))[..., :s]).transpose(1, 2)
        h, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        q, k, v = qkv.float().split([h * dk, h * dk, h * dv], dim=-1)
        q, k = (_l2norm(x.unflatten(-1, (h, dk))) for x in (q, k))
        beta = self.beta_proj(hidden_states).float().sigmoid()
        o = _recurrent_delta_rule(q * dk**-0.5, k, v.unflatten(-1, (h, dv)), beta)
        return self.out_proj(o.to(hidden_states.dtype).flatten(-2))


class DeltaNetMLP(nn.Module):
    def __init__(self, config: DeltaNetConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeltaNetDecoderLayer(nn.Module):
    def __init__(self, config: DeltaNetConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DeltaNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = DeltaNetMixer(config, layer_idx)
        self.post_attention_layernorm = DeltaNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeltaNetMLP(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden_states = hidden_states + self.mixer(self.input_layernorm(hidden_states), attention_mask=attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeltaNetPreTrainedModel(PreTrainedModel):
    config_class = DeltaNetConfig
    base_model_prefix = "model"
    _no_split_modules = ["DeltaNetDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # a depthwise conv over 4 taps: unit-scale taps keep the conv output at its input's scale
            module.weight.normal_(0.0, 0.5)
        elif isinstance(module, DeltaNetRMSNorm):
            module.weight.fill_(1.0)


class DeltaNetModel(DeltaNetPreTrainedModel):
    def __init__(self, config: DeltaNetConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeltaNetDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DeltaNetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return self.norm(hidden_states)


class DeltaNetForCausalLM(DeltaNetPreTrainedModel, GenerationMixin):
    def __init__(self, config: DeltaNetConfig):
        super().__init__(config)
        self.model = DeltaNetModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        **_kwargs,
    ) -> CausalLMOutputWithPast:
        """No positional encoding (the conv and the recurrence are ordered): ``position_ids`` is
        accepted for the callers' sake and unused; there is no cache (``past_key_values`` must be None)."""
        if past_key_values is not None or use_cache:
            raise ValueError("the tiny DeltaNet keeps no cache: call it with use_cache=False (its config's default)")
        hidden_states = self.model(input_ids, attention_mask=attention_mask)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states))


def register_deltanet() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know ``workbench_deltanet`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, DeltaNetConfig, exist_ok=True)
    AutoModelForCausalLM.register(DeltaNetConfig, DeltaNetForCausalLM, exist_ok=True)


__all__ = ["DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNetMixer", "register_deltanet", "MODEL_TYPE"]
