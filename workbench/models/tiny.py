"""Registry of tiny random-weight architectures (``tiny:<arch>`` specs).

Each entry is a zero-argument builder returning a transformers config built from the
family's *own* config class, so the model code under test is exactly the production
modeling file - only the sizes shrink. Shapes are chosen to exercise the interesting
paths while staying fast on a 2-core CPU:

* hidden 64, 2 layers (MoE: 2 as well - enough to see layer repetition), vocab 512,
  max positions 512;
* 4 query heads / 2 KV heads (GQA), head_dim 16 (set explicitly: not every family
  derives it from hidden/heads), MLP intermediate 128;
* MoE: 4 experts, top-2 routing, expert intermediate 64.

The registry is a plain dict populated declaratively below. :func:`register_tiny_arch`
writes to a registry you pass explicitly (tests and notebooks should pass their own
copy, e.g. ``dict(TINY_ARCHS)``); writing to the module default is allowed but is an
explicit, visible call - nothing here mutates state behind your back.

Attention: every config gets ``_attn_implementation = "sdpa"`` (unless a builder sets
one itself, or the HF class has no SDPA path: then ``"eager"``, ``_supports_sdpa``) because the workbench exports these models and we want the graph to contain
``aten.scaled_dot_product_attention`` - the op the attention passes look for - rather
than a backend-specific kernel. Families that refuse SDPA (Gemma 2's logit soft-capping,
gpt-oss's attention sinks) set ``"eager"``: ``match_eager_attention`` matches their eager
chains too.

MoE experts: in transformers 5 the experts are stacked tensors (``gate_up_proj`` /
``down_proj`` of shape ``[E, ...]``). We leave ``config._experts_implementation`` at its
default (``None`` on the config); checked with transformers 5.23 / torch 2.13 on CPU:
model construction resolves it to ``"grouped_mm"`` (``torch._grouped_mm``), falling
back to ``"eager"`` (a per-expert loop) only where grouped_mm cannot dispatch.

Attention variants: besides the plain families, the registry holds at least one family per
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

A strong oracle: tests and ``workbench check`` compare the workbench's greedy tokens with HF's on
the same random weights, which proves something only if HF's tokens depend on the context. At
transformers' default init (``initializer_range`` 0.02) the layers barely move the residual stream,
so greedy decoding follows the last token's embedding: of the 70 archs (the check's 4 prompts, 16
tokens each), 17 gave fewer than 8 distinct tokens for some prompt, 11 at most 3, and 6 (tied heads)
repeated the last prompt token 16 times -- runs that also "match" with broken attention or a broken
cache. ``build_tiny_config`` therefore sets, where the builder left the config class's
default (``oracle_defaults``): ``initializer_range`` ``TINY_INIT_STD`` (0.3) and an untied LM head
(Gemma's embedding, scaled by sqrt(hidden), otherwise dominates a tied head at any init). A builder
that sets either field itself keeps its value (``llama`` keeps its tied head, which covers the tied
path); the archs of ``HF_INIT_ARCHS`` keep transformers' init altogether. Checked (transformers
5.23, seed 0): each of the 70 archs here and in ``tiny_families`` then gives 8-16 distinct tokens for
every prompt of the check. ``tests/test_check.py`` checks every registered arch, and ``workbench
check`` reports the count and fails a weaker row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported lazily: it costs ~2 s.
    from transformers import PretrainedConfig

TinyBuilder = Callable[[], "PretrainedConfig"]

from .tiny_families import FAMILY_ARCHS  # noqa: E402  (builders only: no transformers import)

#: Sizes shared by every tiny arch (see module docstring for the reasoning; the table lives in
#: ``tiny_families/sizes.py`` so the family modules share it too).
from .tiny_families.sizes import COMMON, SMALL_TOKEN_IDS  # noqa: E402

#: Extra sizes for mixture-of-experts families.
MOE: dict = dict(num_experts_per_tok=2)
#: Sliding-window size: shorter than the test prompts, so a window layer differs from a full one.
WINDOW = 4
#: One sliding-window layer then one full-attention layer (families with ``layer_types``).
SLIDING_THEN_FULL = ("sliding_attention", "full_attention")


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

    return Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=64, **MOE)


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
            sliding_window=WINDOW,
            layer_types=list(SLIDING_THEN_FULL),
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    # Sliding and full layers with their own RoPE bases, QK-norm, query_pre_attn_scalar scale.
    return Gemma3TextConfig(
        **COMMON, sliding_window=WINDOW, layer_types=list(SLIDING_THEN_FULL), query_pre_attn_scalar=24
    )


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
            sliding_window=WINDOW,
            layer_types=list(SLIDING_THEN_FULL),
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
    return Cohere2Config(**COMMON, sliding_window=WINDOW, layer_types=list(SLIDING_THEN_FULL), **SMALL_TOKEN_IDS)


def _exaone4():
    from transformers import Exaone4Config

    # Sliding and full layers, QK-norm, post-norm residual blocks.
    return Exaone4Config(**COMMON, sliding_window=WINDOW, layer_types=list(SLIDING_THEN_FULL), **SMALL_TOKEN_IDS)


def _granite():
    from transformers import GraniteConfig

    # attention_multiplier is the softmax scale; embedding/residual/logit multipliers around it.
    return GraniteConfig(
        **COMMON, attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0
    )


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


#: name -> builder. The declarative default registry; extend with register_tiny_arch.
TINY_ARCHS: dict[str, TinyBuilder] = {
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
    # SSM / hybrid, delta-rule, MLA and mRoPE families (one module per mechanism)
    **FAMILY_ARCHS,
}


def list_tiny_archs(registry: Mapping[str, TinyBuilder] | None = None) -> list[str]:
    """Sorted names usable as ``tiny:<name>``."""
    return sorted(TINY_ARCHS if registry is None else registry)


def register_tiny_arch(
    name: str,
    builder: TinyBuilder,
    registry: MutableMapping[str, TinyBuilder] | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Add ``builder`` (zero-arg callable returning a config) under ``name``.

    ``registry`` defaults to the module-level :data:`TINY_ARCHS`; pass your own dict to
    keep the change local (and hand it to ``load_model(..., tiny_registry=...)``).
    Refuses to silently replace an existing entry unless ``overwrite=True``.
    """
    if not name or ":" in name or not callable(builder):
        raise ValueError(f"register_tiny_arch needs a non-empty name without ':' and a callable, got {name!r}")
    target = TINY_ARCHS if registry is None else registry
    if name in target and not overwrite:
        raise ValueError(f"tiny arch {name!r} already registered; pass overwrite=True to replace it")
    target[name] = builder


#: The weights' init std of every tiny config whose builder leaves ``initializer_range`` at its class
#: default (see the module docstring: a strong oracle).
TINY_INIT_STD = 0.3
#: Config fields ``oracle_defaults`` sets where the builder left the class default, and their values.
ORACLE_DEFAULTS: dict = dict(initializer_range=TINY_INIT_STD, tie_word_embeddings=False)
#: Archs that keep transformers' init: strong oracles at it already, and HF's own reference breaks at
#: the larger one -- NemotronH's cached decode in HF ``generate`` then disagrees with its full forward
#: (logits RMSE 9e-3, greedy tokens differ), so HF's tokens would be a wrong reference.
HF_INIT_ARCHS = frozenset({"nemotron_h"})


def _class_default(config, field: str):
    """The default of ``field`` in the signature of the config's class (``inspect.Parameter.empty`` if
    the class does not name it)."""
    param = inspect.signature(type(config).__init__).parameters.get(field)
    return inspect.Parameter.empty if param is None else param.default


def oracle_defaults(config: "PretrainedConfig") -> "PretrainedConfig":
    """Set ``ORACLE_DEFAULTS`` on ``config`` and its text config, each field only where it is still the
    class default (a builder's own choice stays). Returns ``config``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for part in {id(config): config, id(text): text}.values():
        for field, value in ORACLE_DEFAULTS.items():
            default = _class_default(part, field)
            if default is not inspect.Parameter.empty and getattr(part, field, default) == default:
                setattr(part, field, value)
    return config


def _supports_sdpa(config) -> bool:
    """HF refuses ``sdpa`` for classes without an SDPA path (RWKV, VaultGemma, ...): those get eager."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


def build_tiny_config(name: str, registry: Mapping[str, TinyBuilder] | None = None) -> "PretrainedConfig":
    """Config for ``tiny:<name>``, with sdpa attention and the strong-oracle defaults
    (``oracle_defaults``). ``KeyError`` if unknown."""
    reg = TINY_ARCHS if registry is None else registry
    config = reg[name]()  # fresh object per call: callers may mutate it freely
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa" if _supports_sdpa(config) else "eager"
    return config if name in HF_INIT_ARCHS else oracle_defaults(config)
