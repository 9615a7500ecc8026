"""A config editor generated from a transform's pydantic config class.

Enums and ``Literal`` fields become dropdowns, bools checkboxes, everything else a text box (ints,
floats and strings as typed; containers as YAML, e.g. ``[1, 2]`` or ``{a: true}``). The form
only collects what the user changed; validation is the config class's own, through
``Workbench.configure``, so the panel shows exactly the error the API would raise.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import ipywidgets as W
import yaml
from pydantic import BaseModel

from ..pipeline.interface import TransformConfig

COMMON_FIELDS = tuple(TransformConfig.model_fields)
READ_ONLY = ("stage",)  # changing the stage is refused by configure(); shown, not edited


class FormError(ValueError):
    """A value could not even be parsed (bad YAML); nothing was applied."""


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    """``Optional[X]`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)) and len(args) == 1:
            return args[0], True
    return tp, False


def field_kind(tp: Any) -> Tuple[str, Optional[Tuple[Any, ...]], bool]:
    """``(kind, choices, optional)``; kind is ``choice``, ``bool``, ``scalar``, ``str`` or ``yaml``."""
    tp, optional = _unwrap_optional(tp)
    if typing.get_origin(tp) is typing.Literal:
        return "choice", typing.get_args(tp), optional
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "choice", tuple(m.value for m in tp), optional
    if tp is bool:
        return "bool", None, optional
    if tp in (int, float):
        return "scalar", None, optional
    if tp is str:
        return "str", None, optional
    return "yaml", None, optional


def _to_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    if isinstance(value, (list, tuple, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value.value if isinstance(value, enum.Enum) else value)


@dataclass
class FieldEditor:
    name: str
    kind: str
    optional: bool
    widget: W.ValueWidget
    initial: Any  # the widget value it was built with

    def parsed(self) -> Any:
        """The value to hand to ``configure`` (raw strings for pydantic to coerce and check)."""
        value = self.widget.value
        if self.kind in ("choice", "bool"):
            return None if value == "(none)" else value
        text = value.strip() if self.kind != "str" else value
        if self.optional and not text.strip():
            return None
        if self.kind == "yaml":
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise FormError(f"field '{self.name}': not valid YAML: {e}") from None
        return text


def _editor(name: str, info, value: Any) -> FieldEditor:
    kind, choices, optional = field_kind(info.annotation)
    common = dict(
        description=name,
        description_tooltip=info.description or "",
        style={"description_width": "190px"},
        layout=W.Layout(width="460px"),
    )
    if isinstance(value, enum.Enum):
        value = value.value
    if kind == "choice":
        assert choices is not None  # a choice field lists them
        options = list(choices) + (["(none)"] if optional else [])
        widget = W.Dropdown(options=options, value="(none)" if value is None else value, **common)
    elif kind == "bool":
        widget = W.Checkbox(value=bool(value), indent=False, **common)
    else:
        widget = W.Text(value=_to_text(value), placeholder="(none)" if optional else "", **common)
    widget.disabled = name in READ_ONLY
    return FieldEditor(name, kind, optional, widget, widget.value)


class ConfigForm:
    """The editor for one transform's current config; ``changes()`` is what to configure."""

    def __init__(self, key: str, config: BaseModel):
        self.key = key
        fields = type(config).model_fields
        own = [n for n in fields if n not in COMMON_FIELDS]
        self.editors: Dict[str, FieldEditor] = {
            n: _editor(n, fields[n], getattr(config, n)) for n in own + list(COMMON_FIELDS)
        }

        def desc(n: str) -> str:
            return f"<span style='color:#666;font-size:90%'>{fields[n].description or ''}</span>"

        rows: List[W.Widget] = [W.HTML(f"<b>{key}</b> <code>{type(config).__name__}</code>")]
        if own:
            rows.append(W.HTML("<i>transform fields</i>"))
        for n in own:
            rows += [self.editors[n].widget, W.HTML(desc(n))]
        rows.append(W.HTML("<i>common fields</i>"))
        rows += [self.editors[n].widget for n in COMMON_FIELDS]
        self.box = W.VBox(rows)

    def changes(self) -> Dict[str, Any]:
        """``{field: parsed value}`` for the editors the user changed (raises ``FormError``)."""
        return {n: e.parsed() for n, e in self.editors.items() if e.widget.value != e.initial}

    def set(self, name: str, value: Any) -> None:
        """Set an editor as a user would type it (tests, notebooks)."""
        self.editors[name].widget.value = value
