"""Checks of a model's files and weights at load, before any transform runs.

What a bad checkpoint otherwise costs a user: a ``config.json`` missing ``hidden_size`` loads with
the architecture's defaults (Llama: 4096) and fails later on a shape; a malformed
``tokenizer.json`` raises ``JSONDecodeError`` without the file's name; a tokenizer whose ids reach
past the embedding runs the whole pipeline and is then blamed on the prompt; a NaN in one weight
makes every numerics cell read ``nan`` and generation fail with a message about the cache. Each is
named here, with the file or tensor and what to do (``ModelSpecError``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from .spec import ModelSpecError

# What a causal LM's config must say; an alias in the config class's ``attribute_map`` (GPT-2's
# ``n_embd``, ``n_layer``) counts, in the config or in its ``text_config``.
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
_CHUNK = 1 << 24  # elements per isfinite pass: bounds the temporary mask to 16 MB


def read_json_files(directory: Path, names: Sequence[str] = JSON_FILES) -> Dict[str, Any]:
    """The parsed JSON files (``names``) of a checkpoint directory, those present; a file that does
    not parse is named with the line and column of the error."""
    parsed = {}
    for name in names:
        path = directory / name
        if not path.is_file():
            continue
        try:
            parsed[name] = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ModelSpecError(f"{path} is not UTF-8 text ({e}): re-save or re-download it") from None
        except json.JSONDecodeError as e:
            raise ModelSpecError(
                f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}: fix or re-download the file"
            ) from None
    return parsed


def missing_config_fields(raw: Dict[str, Any], config: Any) -> List[str]:
    """The ``REQUIRED_CONFIG_FIELDS`` that ``raw`` (config.json as stored) does not set -- transformers
    would fill them with the class's defaults."""
    # attribute_map maps the standard name to the one the class stores and config.json holds
    # (GPT-2: hidden_size -> n_embd); either spelling counts
    aliases: Dict[str, List[str]] = {}
    for name, stored in dict(getattr(type(config), "attribute_map", {}) or {}).items():
        aliases.setdefault(name, []).append(stored)
        aliases.setdefault(stored, []).append(name)
    scopes = [raw] + [v for k, v in raw.items() if k.endswith("_config") and isinstance(v, dict)]
    missing = []
    for name in REQUIRED_CONFIG_FIELDS:
        keys = [name, *aliases.get(name, [])]
        if not any(k in scope for scope in scopes for k in keys):
            missing.append(name)
    return missing


def check_config(directory: Path, raw: Dict[str, Any], config: Any) -> None:
    missing = missing_config_fields(raw, config)
    if missing:
        raise ModelSpecError(
            f"{directory / 'config.json'} does not set {', '.join(missing)} ({type(config).__name__} would fill "
            f"{'it' if len(missing) == 1 else 'them'} with defaults that do not match the weights): add "
            f"{'it' if len(missing) == 1 else 'them'} to config.json"
        )


def check_tokenizer_fits(tokenizer: Any, model: torch.nn.Module, where: str) -> None:
    """A tokenizer whose ids reach past the model's embedding rows cannot feed it."""
    if tokenizer is None:
        return
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    if rows is None:
        return
    n = len(tokenizer)
    if n > rows:
        raise ModelSpecError(
            f"{where}: the tokenizer has {n:,} tokens but the model's embedding has {rows:,} rows, so token ids "
            f"{rows:,}..{n - 1:,} cannot be embedded: the tokenizer files belong to another model (put the model's "
            "own tokenizer beside its weights)"
        )


def non_finite_parameters(model: torch.nn.Module, limit: int = 5) -> List[str]:
    """``"name: count of count"`` for the floating-point parameters holding NaN or Inf (at most
    ``limit``; buffers are left alone: masks legitimately hold -inf)."""
    found = []
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.is_meta or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        # One float64 sum per tensor (NaN and Inf carry through it; fp32 values cannot overflow it):
        # a single read of the weights, ~8x faster than an isfinite mask. Only a tensor whose sum
        # is not finite is counted, chunk by chunk.
        if bool(torch.isfinite(flat.sum(dtype=torch.float64))):
            continue
        bad = 0
        for start in range(0, flat.numel(), _CHUNK):
            bad += int((~torch.isfinite(flat[start : start + _CHUNK])).sum())
        if bad:
            found.append(f"{name}: {bad:,} of {p.numel():,} values")
            if len(found) >= limit:
                break
    return found


def check_finite(model: torch.nn.Module, where: str) -> None:
    bad = non_finite_parameters(model)
    if bad:
        raise ModelSpecError(
            f"{where}: weights hold NaN or Inf ({'; '.join(bad)}): the checkpoint is damaged or was saved from a "
            "diverged run -- every output would be NaN. Re-download or re-save the weights"
        )


__all__ = [
    "read_json_files",
    "missing_config_fields",
    "check_config",
    "check_tokenizer_fits",
    "non_finite_parameters",
    "check_finite",
]
