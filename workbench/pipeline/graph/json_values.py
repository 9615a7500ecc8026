"""Torch's value types of graph arguments (dtypes, devices, layouts, memory formats) as one-key JSON
objects and back, for the on-disk formats that must not run code (``matcher/pattern_store.py``, the
export cache's ``record_json.py``): a name is resolved as an attribute of ``torch`` and kept only if
it is of the expected type; a device is parsed by ``torch.device``."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

#: tag -> the type a ``torch.<name>`` attribute must have
_NAMED = {"dt": torch.dtype, "ly": torch.layout, "mf": torch.memory_format}
TAGS = frozenset({*_NAMED, "dv"})


def encode_torch_value(x: Any) -> Optional[Dict[str, str]]:
    """``{"dt": "float32"}`` and the like for a dtype, device, layout or memory format; None otherwise."""
    if isinstance(x, torch.device):
        return {"dv": str(x)}
    for tag, kind in _NAMED.items():
        if isinstance(x, kind):
            return {tag: str(x).removeprefix("torch.")}
    return None


def decode_torch_value(tag: str, value: Any) -> Any:
    """The value of one ``encode_torch_value`` object; ``ValueError`` for a name of another type."""
    if not isinstance(value, str):
        raise ValueError(f"a torch {tag} is named by a string, not {type(value).__name__}")
    if tag == "dv":
        return torch.device(value)
    out = getattr(torch, value, None)
    if not isinstance(out, _NAMED[tag]):
        raise ValueError(f"torch.{value} is not a {_NAMED[tag].__name__}")
    return out
