"""Reading pipeline YAML: the packaged ``default.yaml`` and users' files, checked strictly.

A key written twice, a transform key outside ``transforms:``, a transform body that is not a
mapping, a file that is not UTF-8 text: each is a ``ConfigError`` naming the file and the key's
line, never a value silently dropped. ``ConfigError``, which every pipeline configuration problem
raises, is defined here because this is the lowest of the config modules; ``config.py`` (merging,
overrides, validation into the ordered pipeline) builds on this one and re-exports it.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import yaml

from ..errors import InputError
from .interface import TRANSFORMS


class ConfigError(InputError):
    """A pipeline configuration problem, with the key, field and source named."""


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


__all__ = ["ConfigError", "KeyLines", "TOP_LEVEL_KEYS", "check_tree", "load_default_yaml", "load_yaml_file"]
