"""``detect_hidden_states_for_capture`` (stage ``pattern_matcher``): find each decoder layer's
output hidden state, for EAGLE-3 style speculative decoding which feeds a draft model with the
hidden states of a few target layers.

A layer's output is the one node inside ``model.layers.<i>`` (by the ``nn_module_stack`` export
records) that is read outside that layer: the residual stream handed to layer ``i + 1`` (or the
final norm). The transform only marks what to capture -- ``node.meta['wb_capture_hidden_state']``
is the layer index, and ``ctx.hidden_states_to_capture`` maps layer -> node name -- so a
later cache stage can add the buffers that store them.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import torch.fx as fx
from pydantic import Field

from ...context import PipelineContext
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import match_info
from .inputs import CAPTURE_KEY

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def default_layers_to_capture(num_hidden_layers: int) -> Set[int]:
    """EAGLE-3's usual choice: an early, a middle and a late layer."""
    n = num_hidden_layers
    return {i for i in (1, n // 2 - 1, n - 4) if 0 <= i < n} or {n - 1}


class DetectHiddenStatesForCaptureConfig(TransformConfig):
    eagle3_layers_to_capture: Optional[Set[int]] = Field(
        default=None,
        description="Decoder layer indices whose output hidden states to capture. None: capture "
        "nothing (no speculative decoding); an empty set: the default early/middle/late layers.",
    )


def layer_of(node: fx.Node) -> Optional[int]:
    """Index of the innermost ``...layers.<i>`` module the node was traced in, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        m = _LAYER.search(path)
        if m:
            return int(m.group(1))
    return None


def layer_outputs(gm: fx.GraphModule) -> Dict[int, fx.Node]:
    """layer index -> the last node of that layer read outside it (the residual stream)."""
    out: Dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        i = layer_of(node)
        if i is not None and any(layer_of(u) != i for u in node.users):
            out[i] = node
    return out


@register("detect_hidden_states_for_capture")
class DetectHiddenStatesForCapture(Transform[DetectHiddenStatesForCaptureConfig]):
    """Mark the output hidden state of each layer in ``eagle3_layers_to_capture``."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        wanted = self.config.eagle3_layers_to_capture
        if wanted is None:
            return match_info(gm, {"hidden_states": 0}, reason="eagle3_layers_to_capture is None")
        outputs = layer_outputs(gm)
        if not wanted:
            wanted = default_layers_to_capture(len(outputs))
        missing: List[int] = sorted(set(wanted) - set(outputs))
        if missing:
            raise ValueError(f"layers {missing} not found; the graph has decoder layers 0..{len(outputs) - 1}")
        captured = {}
        for i in sorted(wanted):
            outputs[i].meta[CAPTURE_KEY] = i
            captured[i] = outputs[i].name
        ctx.hidden_states_to_capture = dict(captured)
        gm, info = match_info(gm, {"hidden_states": len(captured)}, captured=captured)
        # Only metadata changed: the graph stays clean and shapes stay valid.
        return gm, info.model_copy(update={"is_clean": True})
