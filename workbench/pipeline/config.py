"""Pipeline configuration: packaged ``default.yaml``, user YAML deep-merged on top, then dotted
overrides; validated into one pydantic config per transform.

Errors name the transform key, the field and where the bad value came from, because a typo in a
YAML file should cost the user seconds, not a debugging session.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import InputError
from .interface import TRANSFORMS, Stages, TransformConfig, TransformRegistry


class ConfigError(InputError):
    """A pipeline configuration problem, with the key, field and source named."""


@dataclass(frozen=True)
class PipelineEntry:
    key: str
    config: TransformConfig


def load_default_yaml() -> Dict[str, Any]:
    text = resources.files("workbench.pipeline").joinpath("default.yaml").read_text()
    return _parse_yaml(text, "default.yaml (packaged)")


TOP_LEVEL_KEYS = ("transforms",)


def _parse_yaml(text: str, source: str) -> Dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        raise ConfigError(
            f"{source}: not valid YAML{at}: {getattr(e, 'problem', None) or e}. Fix the file, "
            "or leave it out of --yaml-extra"
        ) from None
    return check_tree(data, source)


def check_tree(data: Any, source: str) -> Dict[str, Any]:
    """A config tree must be ``{transforms: {key: {field: value}}}``: anything else at the top level
    (a transform key written without ``transforms:`` above it, a typo) is an error, never ignored."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping with a 'transforms:' mapping of transform key -> "
            f"fields, got {type(data).__name__}"
        )
    unknown = [k for k in data if k not in TOP_LEVEL_KEYS]
    if unknown:
        hint = ""
        keys = [k for k in unknown if str(k) in TRANSFORMS]
        if keys:
            hint = (
                f" ({', '.join(map(repr, keys))} {'is a transform key' if len(keys) == 1 else 'are transform keys'}: "
                "put them under 'transforms:')"
            )
        raise ConfigError(
            f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}{hint}; "
            f"allowed: {', '.join(TOP_LEVEL_KEYS)}"
        )
    if not isinstance(data.get("transforms") or {}, Mapping):
        raise ConfigError(
            f"{source}: 'transforms:' must be a mapping of transform key -> fields, got "
            f"{type(data['transforms']).__name__}"
        )
    return dict(data)


def load_yaml_file(path: Union[str, Path]) -> Dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"YAML file not found: {p}")
    return _parse_yaml(p.read_text(), str(p))


def deep_merge(base: Dict[str, Any], extra: Mapping[str, Any]) -> Dict[str, Any]:
    """``extra`` on top of ``base``; nested mappings merge, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> Tuple[str, Any]:
    """``key.field[.sub]=value`` -> (dotted path, YAML-parsed value)."""
    path, sep, raw = text.partition("=")
    if not sep or "." not in path:
        raise ConfigError(f"override {text!r}: expected transform_key.field=value, e.g. export_to_gm.strict=true")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from e
    return path.strip(), value


def overrides_to_tree(overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"key.field": v}`` -> ``{"transforms": {"key": {"field": v}}}``."""
    tree: Dict[str, Any] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = tree.setdefault("transforms", {})
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def validation_messages(err: ValidationError, known, root: str = "<root>") -> List[str]:
    """One line per pydantic error: an unknown field with the closest known one, or the field's problem."""
    known = sorted(known)
    out = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or root
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][0]), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(f"unknown field '{field}'{hint}; known fields: {', '.join(known)}")
        else:
            out.append(f"field '{field}': {e['msg']} (got {e.get('input')!r})")
    return out


def _format_validation(key: str, err: ValidationError, cls: Type[BaseModel], source: str) -> str:
    lines = [f"transform '{key}' ({source}): invalid config"]
    lines += [f"  - {m}" for m in validation_messages(err, cls.model_fields)]
    return "\n".join(lines)


def build_entries(
    tree: Mapping[str, Any], registry: TransformRegistry = TRANSFORMS, sources: Optional[Mapping[str, str]] = None
) -> List[PipelineEntry]:
    """Validate the merged tree into ordered entries (stable-sorted by stage)."""
    sources = sources or {}
    entries: List[PipelineEntry] = []
    for key, fields in (tree.get("transforms") or {}).items():
        src = sources.get(key, "config")
        if key not in registry:
            close = difflib.get_close_matches(key, list(registry), n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"unknown transform '{key}' ({src}).{hint} Run `workbench transforms` to list the registered keys."
            )
        if fields is None:
            fields = {}
        if not isinstance(fields, Mapping):
            raise ConfigError(f"transform '{key}' ({src}): expected a mapping of fields, got {fields!r}")
        cls = registry.get(key).config_class
        try:
            cfg = cls.model_validate(dict(fields))
        except ValidationError as e:
            raise ConfigError(_format_validation(key, e, cls, src)) from None
        entries.append(PipelineEntry(key, cfg))
    entries.sort(key=lambda e: e.config.stage.order)
    return entries


def resolve_pipeline(
    yaml_extra: Sequence[Union[str, Path, Mapping[str, Any]]] = (),
    overrides: Union[Mapping[str, Any], Iterable[str]] = (),
    registry: TransformRegistry = TRANSFORMS,
    base: Optional[Mapping[str, Any]] = None,
) -> List[PipelineEntry]:
    """default.yaml (or ``base``) <- each ``yaml_extra`` <- ``overrides``, validated and ordered.

    ``overrides`` is a mapping ``{"key.field": value}`` or CLI strings ``"key.field=value"``.
    """
    tree = dict(base) if base is not None else load_default_yaml()
    sources = {k: "default.yaml" for k in tree.get("transforms", {})}
    for extra in yaml_extra:
        name = "yaml_extra" if isinstance(extra, Mapping) else str(extra)
        data = check_tree(extra, name) if isinstance(extra, Mapping) else load_yaml_file(extra)
        for k in data.get("transforms") or {}:
            sources[k] = name
        tree = deep_merge(tree, data)
    if not isinstance(overrides, Mapping):
        overrides = dict(parse_override(o) for o in overrides)
    for dotted in overrides:
        sources[dotted.split(".")[0]] = f"override {dotted}"
    tree = deep_merge(tree, overrides_to_tree(overrides))
    return build_entries(tree, registry, sources)


def apply_global_field(entries: List[PipelineEntry], field: str, value: Any) -> List[PipelineEntry]:
    """Set one common field (e.g. ``debug_visualize_dir``) on every transform that has no value."""
    if field not in TransformConfig.model_fields:
        raise ConfigError(f"'{field}' is not a common transform field")
    out = []
    for e in entries:
        if getattr(e.config, field) is None:
            e = PipelineEntry(e.key, e.config.model_copy(update={field: value}))
        out.append(e)
    return out


__all__ = [
    "ConfigError",
    "PipelineEntry",
    "Stages",
    "resolve_pipeline",
    "deep_merge",
    "parse_override",
    "load_default_yaml",
    "build_entries",
    "apply_global_field",
]
