"""``gather_logits_before_lm_head`` (stage ``cache_init``): compute logits only for the tokens that
sample a next token.

A cached graph runs a whole step of flattened tokens, but generation reads one row of logits per
sequence: the last new token's. Without this transform the LM head runs on every token, which for
a prefill is most of the step's logits work and memory -- 2,048 tokens x 49,152 vocab x fp32 is
403 MB for SmolLM2 (2.1 GB at Llama-3's 128,256 vocab in bf16 over 8,192 tokens), all thrown away
but B rows.
With it the hidden states are gathered first::

    hidden [.., T, H] -> reshape [1, T, H] -> index_select(dim 1, last_token_index [B]) -> lm_head -> [1, B, V]

``last_token_index`` is a new step input (``SequenceInfo`` fills it: the flattened index of each
sequence's last new token). Row-wise ops after the LM head (casts, logit soft-capping) stay after it.
The numerics probe feeds every token's index, so its per-token comparison with the eager model
is unchanged; the runner reads the B rows directly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.fx as fx

from ....runtime.interface import LAST_TOKEN_INPUT
from ...context import PipelineContext
from ...graph.weights import param_of
from ...interface import Transform, TransformInfo, register
from .inputs import find_input, per_sequence_input

aten = torch.ops.aten


def _output_tensor(gm: fx.GraphModule) -> Optional[fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    first = out.args[0]
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    return first if isinstance(first, fx.Node) else None


def find_lm_head(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The projection that produces the logits: walk back from the output through row-wise ops
    of one tensor input (casts, scaling, soft-capping) to the first node that multiplies by a 2-D
    weight. None if the output is not produced that way."""
    node = _output_tensor(gm)
    while isinstance(node, fx.Node) and node.op == "call_function":
        if any(w is not None and w.dim() == 2 for w in (param_of(gm, a) for a in node.args[1:])):
            return node
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        if len(tensor_args) != 1 or node.kwargs and any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return None
        node = tensor_args[0]
    return None


@register("gather_logits_before_lm_head")
class GatherLogitsBeforeLMHead(Transform):
    """Gather each sequence's last token before the LM head: logits [1, B, V] instead of [1, T, V]."""

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            return gm, TransformInfo(num_matches=0, skip_reason="not a graph (transformers mode keeps its LM head)")
        if find_input(gm, "seq_lens") is None:
            return gm, TransformInfo(
                num_matches=0,
                skip_reason="no cache stage ran: the graph returns logits "
                "for every position (enable insert_cached_attention)",
            )
        if find_input(gm, LAST_TOKEN_INPUT) is not None:
            return gm, TransformInfo(num_matches=0, skip_reason="already gathered")
        head = find_lm_head(gm)
        hidden = head.args[0] if head is not None else None
        val = hidden.meta.get("val") if isinstance(hidden, fx.Node) else None
        if head is None or not isinstance(hidden, fx.Node) or val is None or not isinstance(val.shape[-1], int):
            return gm, TransformInfo(num_matches=0, skip_reason="no LM head projection found before the output")
        device = ctx.device
        index = per_sequence_input(gm, LAST_TOKEN_INPUT, torch.int64, device)
        g = gm.graph
        with g.inserting_before(head):
            flat = g.call_function(aten.reshape.default, (hidden, [1, -1, val.shape[-1]]))
            picked = g.call_function(aten.index_select.default, (flat, 1, index))
        head.replace_input_with(hidden, picked)
        gm.recompile()
        return gm, TransformInfo(num_matches=1, details={"lm_head": head.name, "gathered_from": hidden.name})


__all__ = ["GatherLogitsBeforeLMHead", "find_lm_head"]
