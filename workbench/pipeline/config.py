"""Pipeline configuration: packaged ``default.yaml``, user YAML deep-merged on top, then dotted
overrides; validated into one pydantic config per transform.

Errors name the transform key, the field and where the bad value came from, because a typo in a
YAML file should cost the user seconds, not a debugging session.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Type, Union

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
    text = resources.files("workbench.pipeline").joinpath("default.yaml").read_text(encoding="utf-8")
    return _parse_yaml(text, "default.yaml (packaged)")[0]


TOP_LEVEL_KEYS = ("transforms",)

# 1-based line of each top-level key and of each key under ``transforms:``, e.g.
# ``{("transforms", "fuse_swiglu"): 12}``: messages about a key can then point at its line.
KeyLines = Dict[Tuple[str, ...], int]


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping.

    Plain YAML keeps the last value without a word, so a second ``fuse_swiglu:`` block further down
    a file would silently throw the first one away.
    """

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first_line: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<: *anchor' pulls keys in that the keys written here may override
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = first_line.get(key)
                except TypeError:
                    continue  # unhashable key: the base class reports it with its position
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r} (first at line {seen + 1}); YAML would keep only the "
                        "last one, so write each key once",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _key_lines(node: Any) -> KeyLines:
    lines: KeyLines = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        lines[(key_node.value,)] = key_node.start_mark.line + 1
        if key_node.value == "transforms" and isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                if isinstance(sub_key, yaml.ScalarNode):
                    lines[("transforms", sub_key.value)] = sub_key.start_mark.line + 1
    return lines


def _parse_yaml(text: str, source: str) -> Tuple[Dict[str, Any], KeyLines]:
    """The checked tree of one YAML document and the lines of its keys."""
    loader = None
    try:
        loader = _StrictLoader(text)  # checks every character first: a ReaderError comes from here
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or e
        if isinstance(e, yaml.reader.ReaderError):  # a control character: a binary file, most often
            line = text.count("\n", 0, e.position) + 1
            column = e.position - text.rfind("\n", 0, e.position)
            at = f" (line {line}, column {column})"
            problem = f"character U+{e.character:04X}: {e.reason}, so probably not a text file"
        raise ConfigError(
            f"{source}: not valid YAML{at}: {problem}. Fix the file, or leave it out of --yaml-extra"
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    # An empty document (nothing, or only comments) adds nothing; any other non-mapping
    # (``false``, ``[]``, ``0``) is a mistake that check_tree names.
    lines = _key_lines(node)
    return check_tree({} if data is None else data, source, lines), lines


def _at(source: str, lines: Optional[KeyLines], *path: str) -> str:
    line = (lines or {}).get(path)
    return f"{source}, line {line}" if line is not None else source


def check_tree(data: Any, source: str, lines: Optional[KeyLines] = None) -> Dict[str, Any]:
    """A config tree must be ``{transforms: {key: {field: value}}}``: anything else at the top level
    (a transform key written without ``transforms:`` above it, a typo) is an error, never ignored.

    An empty ``transforms:`` (null, e.g. every entry under it commented out) is returned as ``{}``:
    it merges nothing, like ``transforms: {}``, instead of replacing the pipeline with nothing. A
    transform's body must be a mapping of fields or empty (null); what an empty body means depends
    on the tree it merges into, so ``resolve_pipeline`` decides that. ``lines`` (from the YAML
    parser) lets the messages point at the key's line.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping with a 'transforms:' mapping of transform key -> "
            f"fields, got {type(data).__name__}. Start the file with 'transforms:' and write each "
            "transform key indented below it"
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
    out = dict(data)
    if "transforms" not in out:
        return out
    transforms = {} if out["transforms"] is None else out["transforms"]
    if not isinstance(transforms, Mapping):
        raise ConfigError(
            f"{_at(source, lines, 'transforms')}: 'transforms:' must be a mapping of transform key -> "
            f"fields, got {type(transforms).__name__} {transforms!r}. Write each transform as 'key:' "
            "indented below it, with its fields indented below the key (not as a '- key' list item)"
        )
    for key, body in transforms.items():
        where = _at(source, lines, "transforms", str(key))
        if not isinstance(key, str):
            raise ConfigError(
                f"{where}: transform key {key!r} under 'transforms:' is not a name (got "
                f"{type(key).__name__}); write the transform's key (`workbench transforms` lists them)"
            )
        if body is not None and not isinstance(body, Mapping):
            raise ConfigError(
                f"transform '{key}' ({where}): expected a mapping of fields, got "
                f"{type(body).__name__} {body!r}. Write its fields indented below '{key}:' (e.g. "
                f"'enabled: false'), or leave the body empty to keep the entry as it is"
            )
    out["transforms"] = dict(transforms)
    return out


def _read_text(p: Path) -> str:
    """The text of a user YAML file, or a ConfigError saying why it cannot be had."""
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a YAML file; give the path of a .yaml file")
    if not p.exists():
        raise ConfigError(f"YAML file not found: {p} (resolved to {p.resolve()}); check the path")
    if not p.is_file():  # a FIFO or device: reading one may block or never end
        raise ConfigError(f"{p}: not a regular file; give the path of a .yaml file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(
            f"{p}: cannot be read ({e.strerror or e}); make it readable, or leave it out of --yaml-extra"
        ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}), so not a YAML file "
            "this can read: save it as UTF-8, or leave it out of --yaml-extra if it is not a YAML file"
        ) from None


def _load_yaml_file_lines(path: Union[str, "os.PathLike[str]"]) -> Tuple[Dict[str, Any], KeyLines]:
    p = Path(path)
    return _parse_yaml(_read_text(p), str(p))


def load_yaml_file(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    return _load_yaml_file_lines(path)[0]


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
