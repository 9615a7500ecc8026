"""Model factory: ``load_model(spec)`` for smollm2 / tiny:<arch> / local dirs / HF cache ids."""

from .dtypes import resolve_dtype
from .factory import load_model
from .loaded import LoadedModel
from .spec import ModelSpecError, resolve_spec
from .tiny import TINY_ARCHS, build_tiny_config, list_tiny_archs, register_tiny_arch

__all__ = [
    "LoadedModel",
    "ModelSpecError",
    "TINY_ARCHS",
    "build_tiny_config",
    "list_tiny_archs",
    "load_model",
    "register_tiny_arch",
    "resolve_dtype",
    "resolve_spec",
]
