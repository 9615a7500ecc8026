"""The tiny random configs of the plain dense and MoE families and of the attention variants
(``tiny:<arch>``; ``tiny.py`` merges ``ARCHS`` with ``tiny_families``' into ``TINY_ARCHS``).

Each builder returns a transformers config of the family's *own* config class at the shared tiny
sizes (``COMMON``, ``tiny.py`` explains them), so the model code under test is exactly the
production modeling file. MoE families add ``MOE`` (top-2 routing).

Attention variants: besides the plain families, this module holds at least one family per
attention variant the pipeline must canonicalize and cache (each checked: every attention layer
cached, greedy tokens equal to HF's): logit soft-capping + sliding/full layers (``gemma2``),
sliding/full layers + QK-norm + a custom scale (``gemma3``, ``cohere2``, ``exaone4``), a sliding
window on every layer (``mistral_sliding``, ``starcoder2``), attention sinks (``gpt_oss``), QK-norm
(``olmo2``, ``qwen3``), partial rotary (``phi``, ``phi3``, ``stablelm``), interleaved RoPE pairs
(``glm``, ``glm4``, ``cohere``), scaled RoPE frequencies (``llama3_rope``, ``qwen2_yarn``), NoPE
layers (``smollm3``), a custom scale and multipliers (``granite``). Windows are ``WINDOW`` tokens,
shorter than the test prompts, so they really hide keys. Families whose default special-token ids
(ids of 50k-250k-token vocabularies) lie outside the tiny vocabulary get ``SMALL_TOKEN_IDS``
(the embedding's ``padding_idx`` must lie inside it: phi3 and glm fail to build otherwise).
"""

from __future__ import annotations

import copy

from .tiny_families.sizes import COMMON, MUP, QWEN_MOE, SLIDING_THEN_FULL, SMALL_TOKEN_IDS, WINDOW
from .tiny_families.sizes import TOP2 as MOE


def _sliding_then_full() -> dict:
    """``SLIDING_THEN_FULL`` (a sliding-window layer, window ``WINDOW``, then a full layer), its list a
    fresh copy: a config keeps the list it is given."""
    return copy.deepcopy(SLIDING_THEN_FULL)


def _eager(config):
    """For families whose modeling code refuses SDPA (it cannot express their attention)."""
    config._attn_implementation = "eager"
    return config


def _llama():
    from transformers import LlamaConfig

    # Tied embeddings like SmolLM2 (the default real model, also Llama): keeps the
    # tied lm_head path covered by the fast tiny tests.
    return LlamaConfig(**COMMON, tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**COMMON)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON)


def _mixtral():
    from transformers import MixtralConfig

    # Mixtral experts use `intermediate_size` (there is no separate moe size).
    return MixtralConfig(**{**COMMON, "intermediate_size": 64}, num_local_experts=4, **MOE)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**COMMON, **QWEN_MOE)


# ------------------------------------------------------------------------ attention variants


def _mistral_sliding():
    from transformers import MistralConfig

    # Every layer sliding (Mistral 7B v0.1's window), mask built from the config's window.
    return MistralConfig(**COMMON, sliding_window=WINDOW)


def _llama3_rope():
    from transformers import LlamaConfig

    # Llama 3.1's frequency scaling: low frequencies divided by `factor`, a smooth ramp between.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**COMMON, rope_parameters=rope)


def _qwen2_yarn():
    from transformers import Qwen2Config

    # YaRN: interpolated frequencies and cos/sin scaled by the attention factor (0.1 ln(4) + 1).
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    return Qwen2Config(**COMMON, rope_parameters=rope)


def _gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**COMMON)


def _gemma2():
    from transformers import Gemma2Config

    # Soft-capped attention logits (50 * tanh(x / 50)) and final logits, a sliding and a full layer,
    # scale query_pre_attn_scalar**-0.5 (not head_dim**-0.5). Gemma2ForCausalLM refuses SDPA.
    return _eager(
        Gemma2Config(
            **COMMON,
            **_sliding_then_full(),
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    # Sliding and full layers with their own RoPE bases, QK-norm, query_pre_attn_scalar scale.
    return Gemma3TextConfig(**COMMON, **_sliding_then_full(), query_pre_attn_scalar=24)


def _gpt_oss():
    from transformers import GptOssConfig

    # Attention sinks (a learned softmax logit per head): GptOssForCausalLM refuses SDPA, so its eager
    # chain is exported. Default rope (the yarn default warns about max_position_embeddings at this
    # size); a sliding and a full layer, as in the real model.
    return _eager(
        GptOssConfig(
            **{**COMMON, "intermediate_size": 64},
            num_local_experts=4,
            **MOE,
            **_sliding_then_full(),
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    )


def _olmo():
    from transformers import OlmoConfig

    return OlmoConfig(**COMMON, **SMALL_TOKEN_IDS)


def _olmo2():
    from transformers import Olmo2Config

    # QK-norm over the whole projection (RMSNorm of n_heads * head_dim), before the head split.
    return Olmo2Config(**COMMON, **SMALL_TOKEN_IDS)


def _phi():
    from transformers import PhiConfig

    # Partial rotary (half the head dim), parallel attention + MLP, biases, LayerNorm.
    return PhiConfig(**COMMON)


def _phi3():
    from transformers import Phi3Config

    # Fused qkv / gate_up projections; partial rotary as Phi-4-mini has it.
    return Phi3Config(**COMMON, partial_rotary_factor=0.5, **SMALL_TOKEN_IDS)


def _stablelm():
    from transformers import StableLmConfig

    # Partial rotary (default factor 0.25: 4 of 16 dims), LayerNorm.
    return StableLmConfig(**COMMON)


def _glm():
    from transformers import GlmConfig

    # Interleaved RoPE pairs (x[0::2], x[1::2]) on half the head dim.
    return GlmConfig(**COMMON, **SMALL_TOKEN_IDS)


def _glm4():
    from transformers import Glm4Config

    return Glm4Config(**COMMON, **SMALL_TOKEN_IDS)


def _cohere():
    from transformers import CohereConfig

    # Interleaved RoPE pairs, LayerNorm, parallel attention + MLP, scaled logits.
    return CohereConfig(**COMMON, **SMALL_TOKEN_IDS)


def _cohere2():
    from transformers import Cohere2Config

    # A sliding layer with RoPE, a full layer without (NoPE).
    return Cohere2Config(**COMMON, **_sliding_then_full(), **SMALL_TOKEN_IDS)


def _exaone4():
    from transformers import Exaone4Config

    # Sliding and full layers, QK-norm, post-norm residual blocks.
    return Exaone4Config(**COMMON, **_sliding_then_full(), **SMALL_TOKEN_IDS)


def _granite():
    from transformers import GraniteConfig

    # attention_multiplier is the softmax scale; embedding/residual/logit multipliers around it.
    return GraniteConfig(**COMMON, **MUP)


def _starcoder2():
    from transformers import Starcoder2Config

    # Sliding window on every layer, biases, LayerNorm, GELU MLP.
    return Starcoder2Config(**COMMON, sliding_window=WINDOW, **SMALL_TOKEN_IDS)


def _helium():
    from transformers import HeliumConfig

    return HeliumConfig(**COMMON)


def _smollm3():
    from transformers import SmolLM3Config

    # no_rope_layers: 1 = RoPE, 0 = NoPE; the real model drops RoPE every 4th layer.
    return SmolLM3Config(**COMMON, no_rope_layers=[1, 0], **SMALL_TOKEN_IDS)


#: name -> builder of the families above, in registry order.
ARCHS: dict = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    # attention variants and more dense families (see the module docstring)
    "mistral_sliding": _mistral_sliding,
    "llama3_rope": _llama3_rope,
    "qwen2_yarn": _qwen2_yarn,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
    "olmo": _olmo,
    "olmo2": _olmo2,
    "phi": _phi,
    "phi3": _phi3,
    "stablelm": _stablelm,
    "glm": _glm,
    "glm4": _glm4,
    "cohere": _cohere,
    "cohere2": _cohere2,
    "exaone4": _exaone4,
    "granite": _granite,
    "starcoder2": _starcoder2,
    "helium": _helium,
    "smollm3": _smollm3,
}

__all__ = ["ARCHS", "MOE", "SLIDING_THEN_FULL", "WINDOW"]
