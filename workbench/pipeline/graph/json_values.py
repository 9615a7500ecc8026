"""Leaf values of graph arguments that JSON has no spelling for -- torch's dtypes, devices, layouts and
memory formats, and non-finite floats -- as one-key JSON objects and back, for the on-disk formats
that must not run code (``matcher/pattern_store.py``, the export cache's ``record_json.py``): a name
is resolved as an attribute of ``torch`` and kept only if it is of the expected type; a device is
parsed by ``torch.device``; a float is one of ``inf``, ``-inf``, ``nan``."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

#: tag -> the type a ``torch.<name>`` attribute must have
_NAMED = {"dt": torch.dtype, "ly": torch.layout, "mf": torch.memory_format}
TAGS = frozenset({*_NAMED, "dv", "F"})
_NON_FINITE = ("inf", "-inf", "nan")


def encode_leaf(x: Any) -> Optional[Dict[str, str]]:
    """``{"dt": "float32"}`` and the like for a dtype, device, layout or memory format, ``{"F": "inf"}``
    for a non-finite float; None otherwise (JSON spells it, or neither format holds it)."""
    if isinstance(x, float) and not math.isfinite(x):
        return {"F": repr(x)}
    if isinstance(x, torch.device):
        return {"dv": str(x)}
    for tag, kind in _NAMED.items():
        if isinstance(x, kind):
            return {tag: str(x).removeprefix("torch.")}
    return None


def decode_leaf(tag: str, value: Any) -> Any:
    """The value of one ``encode_leaf`` object; ``ValueError`` for a name of another type."""
    if not isinstance(value, str):
        raise ValueError(f"a {tag} value is named by a string, not {type(value).__name__}")
    if tag == "F":
        if value not in _NON_FINITE:
            raise ValueError(f"{value!r} is not a non-finite float")
        return float(value)
    if tag == "dv":
        return torch.device(value)
    out = getattr(torch, value, None)
    if not isinstance(out, _NAMED[tag]):
        raise ValueError(f"torch.{value} is not a {_NAMED[tag].__name__}")
    return out
