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

The registry is a plain dict, ``TINY_ARCHS``: the builders of ``tiny_archs`` (the plain dense and
MoE families, the attention variants) and of ``tiny_families`` (one module per mechanism).
:func:`register_tiny_arch` writes to a registry you pass explicitly (tests and notebooks should pass
their own copy, e.g. ``dict(TINY_ARCHS)``); writing to the module default is allowed but is an
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

from .tiny_archs import ARCHS  # noqa: E402  (builders only: no transformers import)
from .tiny_families import FAMILY_ARCHS  # noqa: E402  (builders only: no transformers import)
from .tiny_families.sizes import ORACLE  # noqa: E402  (plain data, like TINY_INIT_STD)
from .tiny_families.sizes import TINY_INIT_STD as TINY_INIT_STD  # noqa: E402  (re-exported)

#: name -> builder. The declarative default registry; extend with register_tiny_arch.
TINY_ARCHS: dict[str, TinyBuilder] = {
    # the plain dense and MoE families, the attention variants (tiny_archs.py)
    **ARCHS,
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


#: Config fields ``oracle_defaults`` sets where the builder left the class default, and their values
#: (see the module docstring: a strong oracle): ``sizes.ORACLE`` -- init std ``TINY_INIT_STD``, an
#: untied head --, which the families' ``oracle_config`` sets explicitly.
ORACLE_DEFAULTS: dict = ORACLE
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
