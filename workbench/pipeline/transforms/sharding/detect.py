"""Find the shardable regions of a canonical graph and cut them for one rank (``detect_sharding``).

Regions, in the order they claim nodes:

* **mha**: a ``torch_attention`` node (bsnd). Q, K and V are traced back through per-head ops
  (view/reshape/transpose, the RoPE op, per-head norms, casts) to their linears, the output
  forward through reshapes to the O linear. Heads go to ranks whole: with ``G >= W`` KV heads each
  rank takes a contiguous block of KV heads and their query groups (9 query / 3 KV heads on 2
  ranks: 6+3 query heads, 2+1 KV heads); with fewer KV heads than ranks (``W % G == 0``) each KV head
  is copied to ``W / G`` ranks that split its query group. Q/K/V column, O row + all-reduce.
* **moe**: ``torch_moe_fused`` / ``torch_moe``: experts in contiguous blocks per rank (EP), the
  router replicated, tokens routed elsewhere skipped (``torch_moe_local_experts`` maps the global
  ids to local ones or -1), the partial sums all-reduced.
* **lm_head**: the linear that makes the logits, split by vocabulary rows, logits all-gathered.
* **mlp**: a ``torch_swiglu_mlp`` node, or any linear whose input comes from other linears through
  element-wise ops only (``silu(gate(x)) * up(x)``, ``gelu(fc1(x))``): those column, it row.

Anything else stays replicated; regions built around ops with no rule are listed with the reason.

``Detector`` runs the finders in that order and collects the plan: the attention finder is in
``detect_attention.py``, the MoE / LM-head / MLP ones in ``detect_mlp.py``, the cuts they share in
``detect_cuts.py``.
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
