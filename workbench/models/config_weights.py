"""What is wrong when a directory's config.json disagrees with its weights: ``config_weights_disagreement``.

``from_pretrained`` is asked to let mismatched sizes through and to return its loading info, so that
a config.json that does not describe the weights (a tensor of another shape, layers missing or left
over) is refused with one message naming config.json, the weights file, the first differing tensor
with both shapes, the config values to look at, and what to do -- instead of a model loaded with
random or dropped weights. The checkpoint's shapes are read from the safetensors headers only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .spec import WEIGHT_PATTERNS


def _weight_files(directory: Path) -> List[Path]:
    return sorted({p for pat in WEIGHT_PATTERNS for p in directory.glob(pat)})


def _checkpoint_shapes(files: Sequence[Path]) -> Dict[str, Tuple[Path, List[int]]]:
    """Tensor name -> (file, shape) of the safetensors files, read from their headers only (no
    tensor is loaded); ``.bin`` files are not read (their names need unpickling the whole file)."""
    from safetensors import safe_open

    shapes: Dict[str, Tuple[Path, List[int]]] = {}
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    shapes[key] = (f, list(st.get_slice(key).get_shape()))
    return shapes


def _config_values_of(config, sizes: set) -> str:
    """``"intermediate_size=256"``: the config.json values equal to one of ``sizes`` (the dims in
    which the model built from config.json differs from the checkpoint): where to look."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hits = [
        f"{k}={v}" for k, v in text.to_dict().items() if isinstance(v, int) and not isinstance(v, bool) and v in sizes
    ]
    return f" (config.json has {', '.join(hits)})" if hits else ""


def _layers_note(config, keys: Sequence[str]) -> str:
    """``"; the weights hold 2 layers, config.json says num_hidden_layers=3"`` when they differ."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {int(m.group(1)) for k in keys if (m := re.search(r"\.layers\.(\d+)\.", k))}
    layers = getattr(text, "num_hidden_layers", None)
    if found and layers is not None and len(found) != layers:
        return f"; the weights hold {len(found)} layers, config.json says num_hidden_layers={layers}"
    return ""


def config_weights_disagreement(directory: Path, model: torch.nn.Module, info: Mapping) -> Optional[str]:
    """What is wrong when the model built from ``directory``'s config.json does not match its
    weights (``info``: ``from_pretrained(output_loading_info=True)``'s missing / unexpected /
    mismatched tensor names, with HF's renames and tied or ignorable tensors already taken out),
    or None when they match. Names config.json, the weights file, the first differing tensor
    (in the model's order) with both shapes, and what to do."""
    missing, unexpected = list(info.get("missing_keys") or ()), list(info.get("unexpected_keys") or ())
    mismatched = list(info.get("mismatched_keys") or ())
    if not (missing or unexpected or mismatched):
        return None
    files = _weight_files(directory)
    shapes = _checkpoint_shapes(files)
    names = ", ".join(f.name for f in files)
    order = {k: i for i, k in enumerate(model.state_dict())}
    config = model.config

    def where(key: str) -> str:
        return shapes[key][0].name if key in shapes else names

    if mismatched:
        mismatched.sort(key=lambda m: order.get(m[0], len(order)))
        key, ckpt, built = mismatched[0]
        more = f"; {len(mismatched) - 1} more tensors differ" if len(mismatched) > 1 else ""
        what = (
            f"{key} is {list(ckpt)} in {where(key)}, but {list(built)} in the model that config.json describes"
            f"{_config_values_of(config, set(built) - set(ckpt))}{more}"
        )
    elif missing:
        missing.sort(key=lambda k: order.get(k, len(order)))
        built = model.state_dict().get(missing[0])
        what = (
            f"the model that config.json describes has {len(missing)} tensors that are not in the weights, first "
            f"{missing[0]}{f' {list(built.shape)}' if built is not None else ''}{_layers_note(config, list(shapes))}"
        )
    else:
        unexpected.sort(key=_natural)
        first = unexpected[0]
        what = (
            f"the weights hold {len(unexpected)} tensors that the model config.json describes has no place for, "
            f"first {first}{f' {shapes[first][1]}' if first in shapes else ''} in {where(first)}"
            f"{_layers_note(config, list(shapes))}"
        )
    return (
        f"{directory}: config.json disagrees with the weights ({names}): {what}. Use the config.json that was "
        "saved with these weights (save_pretrained writes both), or correct the config.json values named here."
    )


def _natural(key: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


__all__ = ["config_weights_disagreement"]
