"""Pipeline configuration: packaged ``default.yaml``, user YAML deep-merged on top, then dotted
overrides; validated into one pydantic config per transform.

Errors name the transform key, the field and where the bad value came from, because a typo in a
YAML file should cost the user seconds, not a debugging session. Reading and checking the YAML
files themselves is ``config_yaml.py``'s job.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Type, Union

import yaml
from pydantic import BaseModel, ValidationError

from .config_yaml import ConfigError, KeyLines, _at, _load_yaml_file_lines, check_tree, load_default_yaml
from .interface import TRANSFORMS, Stages, TransformConfig, TransformRegistry


@dataclass(frozen=True)
class PipelineEntry:
    key: str
    config: TransformConfig


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
    unions: Dict[str, Tuple[List[str], Any]] = {}  # field -> (allowed values, input) of a union of Literals
    for e in err.errors():
        loc = e["loc"]
        if e["type"] == "literal_error" and len(loc) == 2 and str(loc[1]).startswith("literal["):
            # ``Union[Literal["auto"], Literal[...]]``: pydantic reports each member; say one allowed list
            allowed, _ = unions.setdefault(str(loc[0]), ([], e.get("input")))
            allowed.append(str(e.get("ctx", {}).get("expected", "")))
            continue
        field = ".".join(str(x) for x in loc) or root
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][0]), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(f"unknown field '{field}'{hint}; known fields: {', '.join(known)}")
        else:
            out.append(f"field '{field}': {e['msg']} (got {e.get('input')!r})")
    for field, (allowed, given) in unions.items():
        out.append(f"field '{field}': Input should be {' or '.join(a for a in allowed if a)} (got {given!r})")
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


YamlExtra = Union[str, "os.PathLike[str]", Mapping[str, Any]]


def yaml_extra_list(yaml_extra: Union[YamlExtra, Iterable[YamlExtra], None]) -> List[YamlExtra]:
    """One path or mapping is a list of one: iterating a path string would read each character as
    a file name."""
    if yaml_extra is None:
        return []
    if isinstance(yaml_extra, bytes):
        raise ConfigError("yaml_extra: got bytes; give the file path as a str or pathlib.Path")
    if isinstance(yaml_extra, (str, os.PathLike, Mapping)):
        return [yaml_extra]
    try:
        items = list(yaml_extra)
    except TypeError:
        raise ConfigError(
            f"yaml_extra: expected a YAML file path, a mapping, or a list of them, got {type(yaml_extra).__name__}"
        ) from None
    for i, item in enumerate(items):
        if not isinstance(item, (str, os.PathLike, Mapping)):
            raise ConfigError(
                f"yaml_extra[{i}]: expected a YAML file path or a mapping, got {type(item).__name__} {item!r}"
            )
    return items


def _override_items(overrides: Union[Mapping[str, Any], Iterable[str], str, None]) -> Mapping[str, Any]:
    """``{"key.field": value}`` from a mapping, one ``"key.field=value"`` string, or an iterable of them."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return overrides
    if isinstance(overrides, str):
        overrides = [overrides]
    items = list(overrides)
    for o in items:
        if not isinstance(o, str):
            raise ConfigError(f"override {o!r}: expected a 'transform_key.field=value' string, got {type(o).__name__}")
    return dict(parse_override(o) for o in items)


def _empty_body_error(key: str, where: str, registry: TransformRegistry) -> ConfigError:
    stages = "|".join(s.value for s in Stages)
    unknown = ""
    if key not in registry:
        close = difflib.get_close_matches(key, list(registry), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        unknown = f" Note that '{key}' is not a registered transform.{hint} `workbench transforms` lists the keys."
    return ConfigError(
        f"transform '{key}' ({where}): empty body, and '{key}' is not in the pipeline so far "
        f"(default.yaml plus the yaml_extra before this one), so there is no entry to keep. To add it, "
        f"write a stage and its fields below it:\n  {key}:\n    stage: <{stages}>\n    <field>: <value>\n"
        f"or remove the line.{unknown}"
    )


def resolve_pipeline(
    yaml_extra: Union[YamlExtra, Iterable[YamlExtra], None] = (),
    overrides: Union[Mapping[str, Any], Iterable[str], str, None] = (),
    registry: TransformRegistry = TRANSFORMS,
    base: Optional[Mapping[str, Any]] = None,
) -> List[PipelineEntry]:
    """default.yaml (or ``base``) <- each ``yaml_extra`` <- ``overrides``, validated and ordered.

    ``yaml_extra``: YAML file paths (str or ``os.PathLike``) and mappings, in order; a single path
    or mapping is taken as a list of one. ``overrides``: a mapping ``{"key.field": value}``, CLI
    strings ``"key.field=value"``, or one such string.

    In a YAML file or mapping, an empty ``transforms:`` merges nothing (as ``transforms: {}``), and a
    transform key with an empty body keeps that entry as it is; an empty body for a key that is not
    in the pipeline yet is an error, since there would be no stage to run it in.
    """
    tree = dict(base) if base is not None else load_default_yaml()
    sources = {k: "default.yaml" for k in tree.get("transforms") or {}}
    for extra in yaml_extra_list(yaml_extra):
        lines: KeyLines = {}
        if isinstance(extra, Mapping):
            name = "yaml_extra"
            data = check_tree(extra, name)
        else:
            name = os.fspath(extra)
            data, lines = _load_yaml_file_lines(extra)
        if "transforms" in data:
            merged = {}
            for key, body in data["transforms"].items():
                if body is None:
                    if key not in (tree.get("transforms") or {}):
                        raise _empty_body_error(key, _at(name, lines, "transforms", key), registry)
                    continue
                merged[key] = body
                sources[key] = name
            data = {**data, "transforms": merged}
        tree = deep_merge(tree, data)
    override_map = _override_items(overrides)
    for dotted in override_map:
        sources[dotted.split(".")[0]] = f"override {dotted}"
    tree = deep_merge(tree, overrides_to_tree(override_map))
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
