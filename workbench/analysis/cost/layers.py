"""Which decoder layer each node of a graph belongs to (``assign_layers``): the per-layer sums of
the cost table.

A node's layer comes from its module stack, else from the parameters and cache inputs it reads,
else from its inputs (graph order); nodes outside every layer are "embed" before the first layer
and "head" after.
"""

from __future__ import annotations

import re
from typing import Optional

import torch.fx as fx

_LAYER = re.compile(r"layers[._](\d+)[._]")
_CACHE_LAYER = re.compile(r"_cache_(\d+)$")


def _layer_in(text: str) -> Optional[str]:
    m = _LAYER.search(text + ".")
    return f"layer {int(m.group(1)):02d}" if m else None


def assign_layers(gm: fx.GraphModule) -> dict:
    """Node -> "layer NN", "embed" or "head": the decoder layer from the node's module stack, else
    from the parameters and cache inputs it reads, else from its inputs (graph order); nodes
    outside every layer are "embed" before the first layer and "head" after."""
    out: dict = {}
    seen_layer = False
    for n in gm.graph.nodes:
        layer = None
        stack = n.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            layer = _layer_in(str(path)) or layer
        if layer is None:
            for a in n.all_input_nodes:
                if a.op == "get_attr":
                    layer = _layer_in(str(a.target))
                elif a.op == "placeholder" and _CACHE_LAYER.search(str(a.target)):
                    layer = f"layer {int(_CACHE_LAYER.search(str(a.target)).group(1)):02d}"  # type: ignore[union-attr]
                if layer:
                    break
        if layer is None and not stack:
            layer = next((out[a] for a in n.all_input_nodes if out.get(a, "").startswith("layer")), None)
        if layer is None:
            layer = "head" if seen_layer else "embed"
        seen_layer = seen_layer or layer.startswith("layer")
        out[n] = layer
    return out


__all__ = ["assign_layers"]
