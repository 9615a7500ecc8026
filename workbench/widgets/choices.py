"""The global selectors: what each one changes in the pipeline, and which options can run here.

A selector is a view over transform config fields (``Selector.targets``); picking an option calls
``Workbench.configure`` on those fields, nothing else. Whether an option can run on this machine
is answered with a reason, so the panel can show it disabled instead of letting it fail later.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from ..ops.backends import ATTENTION_BACKENDS
from ..ops.registry import BackendRegistry
from ..runtime.backends import COMPILE_BACKENDS

NO_CUDA = "no CUDA GPU on this machine"
NOT_IN_PIPELINE = "stage not in this pipeline yet"

Reason = Optional[str]  # None: available; otherwise why not


def attention_backend_reason(backend: str, device: torch.device) -> Reason:
    """Why an ``insert_cached_attention`` backend cannot run on ``device`` (None if it can): the
    registry's answer, the same the transform gets."""
    if backend == "auto":
        return None  # resolves to a backend that runs here
    if backend not in ATTENTION_BACKENDS:
        return f"unknown backend {backend!r}"
    why = ATTENTION_BACKENDS.get(backend).unavailable_reason(torch.device(device))
    if why is None:
        return None
    return f"{NO_CUDA}: {why}" if not torch.cuda.is_available() else why


def compile_backend_reason(backend: str, device: torch.device) -> Reason:
    """Why a ``compile_model`` backend cannot run here (None if it can): the transform's own answer."""
    from ..pipeline.transforms.compile.compile_model import backend_unavailable_reason

    return backend_unavailable_reason(backend, device)


def _literal_options(key: str, field: str) -> Tuple[str, ...]:
    """The values a transform's config field takes (its ``Literal``), in declaration order."""
    from ..pipeline.interface import TRANSFORMS

    return tuple(typing.get_args(TRANSFORMS.get(key).config_class.model_fields[field].annotation))


@dataclass(frozen=True)
class Selector:
    """One global selector: its options and the ``(transform key, field)`` pairs it sets."""

    name: str
    label: str
    options: Tuple[str, ...]
    targets: Tuple[Tuple[str, str], ...]  # empty: not a transform field (dtype reloads the model)
    reason: Callable[[str, torch.device], Reason] = lambda option, device: None

    def present(self, keys: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
        """The targets whose transform is in the pipeline ``keys``."""
        return tuple(t for t in self.targets if t[0] in keys)

    def unavailable(self, keys: Sequence[str]) -> Reason:
        """Why the whole selector is disabled for a pipeline with these keys (None if it is not)."""
        if self.targets and not self.present(keys):
            return f"{NOT_IN_PIPELINE} ({', '.join(sorted({k for k, _ in self.targets}))})"
        return None


def _backend_selector(
    name: str, backends: BackendRegistry[Any], key: str, reason: Callable[[str, torch.device], Reason]
) -> Selector:
    """The selector of transform ``key``'s ``backend`` field: ``auto`` and every backend of its registry."""
    return Selector(name, f"{name} backend", ("auto", *backends.names()), ((key, "backend"),), reason)


# Options come from the backend registries and the config Literals, never from a list of our own.
SELECTORS: Tuple[Selector, ...] = (
    _backend_selector("attention", ATTENTION_BACKENDS, "insert_cached_attention", attention_backend_reason),
    _backend_selector("compile", COMPILE_BACKENDS, "compile_model", compile_backend_reason),
    Selector(
        "layout",
        "attention + RoPE layout",
        _literal_options("match_attention_layout", "attn_layout"),
        (("match_attention_layout", "attn_layout"), ("match_rope_layout", "expected_layout")),
    ),
    # Not a transform field: the weights are loaded in this dtype, so picking one reloads the model.
    Selector("dtype", "dtype", ("float32", "bfloat16", "float16"), ()),
)
