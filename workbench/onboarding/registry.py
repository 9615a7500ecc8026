"""The model registry ``workbench check`` runs: which models, with which pipeline YAML.

A registry is a YAML file with one top-level key, ``models:``, a list of entries::

    models:
      - name: tiny:llama                       # a model spec, as `workbench run --model` takes it
      - name: tiny:qwen2_5_vl
        yaml_extra: [configs/qwen2_5_vl.yaml]  # relative to the registry file's folder
      - name: smollm2
        gguf_weights: dequantize
        slow: true                             # `workbench check --quick` skips it
      - name: tiny:llama
        label: llama_tp2_hints
        custom_models: sharding_ir             # the sharding-aware model (hint ops in its graph)
        yaml_extra: [configs/enable_sharder_ir.yaml]
        world_size: 2                          # 2 ranks (gloo on CPU)

Loading validates everything that can be checked without loading a model -- unknown fields (with
the closest known one), unknown ``tiny:`` archs (with the known ones), missing ``yaml_extra`` files,
duplicate labels -- and reports the problems of *every* entry at once, each naming its entry, so
one edit fixes them all. Whether a pipeline YAML is valid is left to the run: a bad config is one
entry's failing row, never the end of the whole check.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..models.tiny import list_tiny_archs
from ..pipeline.config import ConfigError, validation_messages

#: The registry shipped with workbench (``workbench check`` without ``--registry``).
DEFAULT_REGISTRY = Path(__file__).resolve().parents[1] / "models" / "registry.yaml"
TINY_PREFIX = "tiny:"
SHARDING_IR = "sharding_ir"  # custom_models: the sharding-aware models (models.custom.SHARDING_IR_MODELS)


class RegistryError(ConfigError):
    """The registry file is malformed; the message names every bad entry and how to fix it."""


class RegistryEntry(BaseModel):
    """One model to check. After ``load_registry`` the ``yaml_extra`` paths are absolute."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="model spec: tiny:<arch>, smollm2, an HF directory or a cached HF id")
    label: Optional[str] = Field(
        None,
        min_length=1,
        description=(
            "row label and --only key; default: the name without 'tiny:'. Needed only to check one model twice "
            "with different settings"
        ),
    )
    yaml_extra: List[str] = Field(
        default_factory=list,
        description=(
            "pipeline YAML files deep-merged on top of default.yaml, in order; relative paths are relative to "
            "the registry file's folder (workbench/models/ for the shipped registry)"
        ),
    )
    overrides: Dict[str, Any] = Field(
        default_factory=dict,
        description=("'transform_key.field': value pairs applied after yaml_extra (as `workbench run --set`)"),
    )
    gguf_weights: Literal["keep", "dequantize"] = Field(
        "dequantize",
        description=(
            "GGUF models only: dequantize to fp32 (the default: the check compares with HF's fp32 model, which "
            "dequantizes too) or keep the file's 4/8-bit weights"
        ),
    )
    weights: Literal["auto", "checkpoint_like_ssm", "as_loaded"] = Field(
        "auto",
        description=(
            "checkpoint_like_ssm: re-draw Mamba-2 mixers like a trained checkpoint before comparing (HF's random "
            "init leaves their state below fp32 resolution, so a broken state cache would not change tokens); "
            "as_loaded: keep the weights; auto: checkpoint_like_ssm for tiny: random models, as_loaded otherwise"
        ),
    )
    slow: bool = Field(False, description="takes long to check (a real checkpoint): `workbench check --quick` skips it")
    custom_models: Union[bool, Dict[str, Any]] = Field(
        True,
        description=(
            "export the custom canonical-op model registered for the config class (workbench/models/custom), if any; "
            "false: the HF class (through the export-time canonical forwards); sharding_ir: the sharding-aware "
            "model whose graph carries tensor-parallel hints (with configs/enable_sharder_ir.yaml)"
        ),
    )
    world_size: int = Field(
        1,
        ge=1,
        le=8,
        description=(
            "ranks the check runs the pipeline on (CPU: gloo on localhost); > 1 compares the sharded run's tokens "
            "with HF's, like world size 1"
        ),
    )

    @field_validator("custom_models", mode="before")
    @classmethod
    def _custom_models(cls, value: Any) -> Any:
        """``true`` / ``false`` / ``sharding_ir`` in YAML; ``sharding_ir`` becomes the mapping
        ``load_model`` takes (a plain dict: it travels to the ranks of a sharded run)."""
        if isinstance(value, bool):
            return value
        if value == SHARDING_IR:
            from ..models.custom import SHARDING_IR_MODELS

            return dict(SHARDING_IR_MODELS)
        raise ValueError(f"custom_models must be true, false or {SHARDING_IR!r}, got {value!r}")

    @property
    def key(self) -> str:
        """What rows and ``--only`` call this entry."""
        if self.label:
            return self.label
        return self.name[len(TINY_PREFIX) :] if self.name.startswith(TINY_PREFIX) else self.name

    @property
    def redraw_ssm(self) -> bool:
        """Whether the check re-draws Mamba-2 mixers (see ``weights``)."""
        if self.weights == "auto":
            return self.name.startswith(TINY_PREFIX)
        return self.weights == "checkpoint_like_ssm"


@dataclass(frozen=True)
class Registry:
    path: Path
    entries: Tuple[RegistryEntry, ...]

    @property
    def keys(self) -> List[str]:
        return [e.key for e in self.entries]

    def select(self, only: Sequence[str] = (), quick: bool = False) -> Tuple[List[RegistryEntry], List[RegistryEntry]]:
        """(entries to run, slow entries skipped by ``quick``). ``only`` names entries by key (``llama``) or
        by model spec (``tiny:llama``); an entry named in ``only`` runs even when slow."""
        by_name: Dict[str, List[RegistryEntry]] = {}
        for e in self.entries:
            for k in {e.key, e.name}:
                by_name.setdefault(k, []).append(e)
        unknown = [o for o in only if o not in by_name]
        if unknown:
            hints = [
                f"{u!r} (did you mean {', '.join(map(repr, close))}?)" if close else repr(u)
                for u in unknown
                for close in [difflib.get_close_matches(u, list(by_name), n=2)]
            ]
            raise RegistryError(
                f"--only names no entry of {self.path}: {', '.join(hints)}; entries: {', '.join(self.keys)}"
            )
        wanted = {id(e) for o in only for e in by_name[o]}
        chosen = [e for e in self.entries if not only or id(e) in wanted]
        skip = quick and not only
        return [e for e in chosen if not (skip and e.slow)], [e for e in chosen if skip and e.slow]


def load_registry(path: Union[str, Path] = DEFAULT_REGISTRY, tiny_registry: Optional[Mapping] = None) -> Registry:
    """Read and validate a registry file (see the module docstring); raises ``RegistryError``."""
    path = Path(path)
    if not path.is_file():
        raise RegistryError(f"model registry not found: {path} (the shipped one is {DEFAULT_REGISTRY})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RegistryError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or set(data) != {"models"} or not isinstance(data["models"], list):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise RegistryError(f"{path}: expected one top-level key 'models:' holding a list of entries, got {got}")
    known_archs = list_tiny_archs(tiny_registry)
    entries: List[RegistryEntry] = []
    problems: List[str] = []
    for i, raw in enumerate(data["models"]):
        where = f"entry {i + 1}" + (f" ({raw.get('label') or raw.get('name')!r})" if isinstance(raw, dict) else "")
        if not isinstance(raw, dict):
            problems.append(f"{where}: expected a mapping with at least 'name:', got {raw!r}")
            continue
        try:
            entry = RegistryEntry.model_validate(raw)
        except ValidationError as e:
            problems.extend(f"{where}: {p}" for p in _describe(e))
            continue
        entry_problems = _check_model(entry, known_archs)
        yaml_paths = []
        for extra in entry.yaml_extra:
            p = Path(extra) if Path(extra).is_absolute() else path.parent / extra
            if not p.is_file():
                entry_problems.append(
                    f"yaml_extra file {extra!r} not found (looked for {p.resolve()}); paths are "
                    f"relative to the registry's folder {path.parent.resolve()}"
                )
            yaml_paths.append(str(p.resolve()))
        problems.extend(f"{where}: {p}" for p in entry_problems)
        entries.append(entry.model_copy(update={"yaml_extra": yaml_paths}))
    seen: Dict[str, int] = {}
    for entry in entries:
        seen[entry.key] = seen.get(entry.key, 0) + 1
    problems.extend(
        f"label {k!r} is used by {n} entries: give each a distinct 'label:'" for k, n in seen.items() if n > 1
    )
    if problems:
        raise RegistryError(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return Registry(path=path, entries=tuple(entries))


def _check_model(entry: RegistryEntry, known_archs: List[str]) -> List[str]:
    """A ``tiny:`` arch must be registered (other specs are resolved when the entry runs: an HF id
    cached on one machine only is that machine's failing row, not a broken registry)."""
    if not entry.name.startswith(TINY_PREFIX):
        return []
    arch = entry.name[len(TINY_PREFIX) :]
    if arch in known_archs:
        return []
    close = difflib.get_close_matches(arch, known_archs, n=2)
    hint = f" (did you mean {', '.join(repr(TINY_PREFIX + c) for c in close)}?)" if close else ""
    return [f"unknown tiny arch {arch!r}{hint}; known: {', '.join(known_archs)}"]


def _describe(err: ValidationError) -> List[str]:
    return validation_messages(err, RegistryEntry.model_fields, root="<entry>")


__all__ = ["DEFAULT_REGISTRY", "Registry", "RegistryEntry", "RegistryError", "load_registry"]
