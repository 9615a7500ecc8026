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
one itself) because the workbench exports these models and we want the graph to contain
``aten.scaled_dot_product_attention`` - the op the attention passes look for - rather
than the eager matmul/softmax chain or a backend-specific kernel.

MoE experts: in transformers 5 the experts are stacked tensors (``gate_up_proj`` /
``down_proj`` of shape ``[E, ...]``). We leave ``config._experts_implementation`` at its
default (``None`` on the config); checked with transformers 5.23 / torch 2.13 on CPU:
model construction resolves it to ``"grouped_mm"`` (``torch._grouped_mm``), falling
back to ``"eager"`` (a per-expert loop) only where grouped_mm cannot dispatch.

gpt_oss is deliberately *not* registered: ``GptOssForCausalLM`` refuses sdpa (it needs
attention sinks), so it would export the eager attention chain. Checked: a builder
returning ``GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
rope_parameters={"rope_type": "default", "rope_theta": 150000.0})`` with
``_attn_implementation = "eager"`` builds, inits and runs; register it yourself if you
want it (the default yarn rope warns about max_position_embeddings at this size).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported lazily: it costs ~2 s.
    from transformers import PretrainedConfig

TinyBuilder = Callable[[], "PretrainedConfig"]

from .tiny_families import FAMILY_ARCHS  # noqa: E402  (builders only: no transformers import)

#: Sizes shared by every tiny arch (see module docstring for the reasoning).
COMMON: dict = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
)
#: Extra sizes for mixture-of-experts families.
MOE: dict = dict(num_experts_per_tok=2)


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


#: name -> builder. The declarative default registry; extend with register_tiny_arch.
TINY_ARCHS: dict[str, TinyBuilder] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
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


def build_tiny_config(name: str, registry: Mapping[str, TinyBuilder] | None = None) -> "PretrainedConfig":
    """Config for ``tiny:<name>``, with sdpa attention. ``KeyError`` if unknown."""
    reg = TINY_ARCHS if registry is None else registry
    config = reg[name]()  # fresh object per call: callers may mutate it freely
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    return config
