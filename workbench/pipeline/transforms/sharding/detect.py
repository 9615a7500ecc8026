"""Find the shardable regions of a canonical graph and cut them for one rank (``detect_sharding``).

``Detector`` runs the region finders in the order they claim nodes and collects the plan:

1. **mha**: ``torch_attention`` nodes, split by heads (``detect_attention.py``);
2. **moe**: ``torch_moe_fused`` / ``torch_moe``, split by experts (``detect_mlp.py``);
3. **lm_head**: the linear that makes the logits, split by vocabulary rows (``detect_mlp.py``);
4. **mlp**: ``torch_swiglu_mlp`` nodes and the remaining linears, split by features (``detect_mlp.py``).

Anything else stays replicated; regions built around ops with no rule are listed with the reason.
The cuts the finders share are in ``detect_cuts.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from ...graph.utils import op_name
from .detect_attention import AttentionRegions
from .detect_cuts import NotShardable, is_call, layer_of, tensor_nbytes
from .detect_mlp import MlpRegions
from .linear_ops import linear_op
from .plan import Region, ShardingPlan

aten, wb = torch.ops.aten, torch.ops.workbench

UNSHARDED_MIXERS = (
    "torch_mla",
    "torch_ssm",
    "torch_causal_conv1d",
    "torch_gated_delta_rule",
    "torch_delta_rule",
    "torch_attention_sdpa",
    "torch_attention_repeat_kv",
    "torch_moe_dense_mlp",
)


class Detector(AttentionRegions, MlpRegions):
    """Runs the region finders in the order they claim nodes (``detect``) and collects the plan."""

    def _add(self, kind: str, anchor: fx.Node, build) -> None:
        if not self.wanted(kind):
            self.regions.append(
                Region(
                    kind,
                    layer_of([anchor]),
                    (anchor.name,),
                    False,
                    "not selected (detect_sharding.sharding_dims / shard_layers)",
                )
            )
            return
        try:
            region = build()
        except NotShardable as e:
            self.regions.append(Region(kind, layer_of([anchor]), (anchor.name,), False, str(e)))
            return
        if region is None:
            return
        self.regions.append(region)
        self.claimed.update(self.by_name[x] for x in region.nodes)

    def detect(self, vocab: int) -> ShardingPlan:
        g = self.gm.graph
        for n in list(g.nodes):
            if is_call(n, wb.torch_attention.default):
                self._add("mha", n, lambda n=n: self.attention(n))
        for n in list(g.nodes):
            if is_call(n, wb.torch_moe_fused.default, wb.torch_moe.default):
                self._add("moe", n, lambda n=n: self.moe(n))
        out = next(n for n in g.nodes if n.op == "output")
        self._add("lm_head", out, lambda: self.lm_head(vocab))
        for n in list(g.nodes):
            if n in self.claimed:
                continue
            if is_call(n, wb.torch_swiglu_mlp.default):
                self._add("mlp", n, lambda n=n: self.swiglu(n))
            elif linear_op(n) is not None:
                self._add("mlp", n, lambda n=n: self.mlp(n))
        for n in g.nodes:
            name = op_name(n)
            if n.op == "call_function" and any(name.startswith(f"workbench.{m}") for m in UNSHARDED_MIXERS):
                self.regions.append(
                    Region(
                        name.split(".")[1],
                        layer_of([n]),
                        (n.name,),
                        False,
                        "no sharding rule for this op: the layer runs whole on every rank",
                    )
                )
            elif is_call(n, aten.embedding.default, wb.torch_int8_embedding.default):
                self.regions.append(
                    Region(
                        "embedding",
                        None,
                        (n.name,),
                        False,
                        "replicated: every rank holds the whole table (no vocab-parallel embedding)",
                        global_bytes=sum(tensor_nbytes(a) for a in n.all_input_nodes if a.op == "get_attr"),
                    )
                )
        order = {"embedding": 0, "lm_head": 2}
        regions = sorted(self.regions, key=lambda r: (order.get(r.kind, 1), r.layer if r.layer is not None else -1))
        return ShardingPlan(self.W, self.rank, self.group, tuple(regions))


def detect_plan(
    gm: fx.GraphModule,
    *,
    world_size: int,
    rank: int,
    group_name: str,
    vocab_size: int,
    dims: Sequence[str] = ("tp", "ep"),
    layers: Optional[Sequence[str]] = None,
) -> ShardingPlan:
    return Detector(gm, world_size, rank, group_name, dims, layers).detect(vocab_size)


__all__ = ["detect_plan", "Detector", "UNSHARDED_MIXERS"]
