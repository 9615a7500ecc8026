"""The feature-split regions of sharding detection: MoE experts, the LM head, MLPs.

* **moe**: ``torch_moe_fused`` / ``torch_moe``: experts in contiguous blocks per rank (EP), the
  router replicated, tokens routed elsewhere skipped (``torch_moe_local_experts`` maps the global
  ids to local ones or -1), the partial sums all-reduced.
* **lm_head**: the linear that makes the logits, split by vocabulary rows, logits all-gathered.
* **mlp**: a ``torch_swiglu_mlp`` node, or any linear whose input comes from other linears through
  element-wise ops only (``silu(gate(x)) * up(x)``, ``gelu(fc1(x))``): those column, it row.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from ...graph.utils import op_name
from .detect_cuts import ELEMENTWISE, PASS_THROUGH, NotShardable, RegionCutter, is_call, layer_of, tensor_nbytes
from .linear_ops import features, linear_op
from .plan import NodeCut, Region, TensorCut, fmt_range, split_evenly

aten, wb = torch.ops.aten, torch.ops.workbench


class MlpRegions(RegionCutter):
    """Finds and cuts the MoE, LM-head and MLP regions (``moe``, ``lm_head``, ``mlp``, ``swiglu``)."""

    def moe(self, node: fx.Node) -> Region:
        layer = layer_of([node])
        fused = node.target is wb.torch_moe_fused.default
        if fused:
            w13, w2 = node.args[3], node.args[4]
            if not (isinstance(w13, fx.Node) and w13.op == "get_attr" and w2.op == "get_attr"):
                raise NotShardable("stacked expert weights are not plain graph tensors")
            experts = int(w13.meta["val"].shape[0])
        else:
            experts = len(node.args[3])
        if experts < self.W:
            raise NotShardable(f"{experts} experts are fewer than the {self.W} ranks (expert TP not implemented)")
        ranges = split_evenly(experts, self.W)
        e0, e1 = ranges[self.rank]
        cuts: Tuple[NodeCut, ...] = ()
        lists = None
        if fused:
            cuts = (
                NodeCut(
                    node.name,
                    "expert",
                    (TensorCut(3, w13.target, 0, ((e0, e1),)), TensorCut(4, w2.target, 0, ((e0, e1),))),
                ),
            )
            whole, local = self.bytes_of(cuts, [node])
        else:
            lists = (node.name, (e0, e1))
            whole = sum(tensor_nbytes(w) for lst in node.args[3:6] for w in lst)
            local = sum(tensor_nbytes(w) for lst in node.args[3:6] for w in lst[e0:e1])
        per_rank = tuple(f"experts {fmt_range(r)}" for r in ranges)
        return Region(
            "moe",
            layer,
            (node.name,),
            True,
            f"{experts} experts by expert (EP), router replicated, + all_reduce",
            per_rank,
            cuts,
            collective=(node.name, "all_reduce"),
            local_experts=(node.name, e0, e1 - e0),
            expert_lists=lists,
            global_bytes=whole,
            local_bytes=local,
        )

    # ------------------------------------------------------------------ LM head
    def lm_head(self, vocab: int) -> Optional[Region]:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        cur = out.args[0]
        cur = cur[0] if isinstance(cur, (tuple, list)) else cur
        while isinstance(cur, fx.Node) and linear_op(cur) is None and is_call(cur, *PASS_THROUGH, *ELEMENTWISE):
            cur = cur.args[0]
        if not isinstance(cur, fx.Node) or linear_op(cur) is None:
            return None
        _, n_out = features(cur)
        if n_out != vocab:
            return None
        ranges = [(r * vocab // self.W, (r + 1) * vocab // self.W) for r in range(self.W)]
        if vocab % self.W:
            raise NotShardable(
                f"vocab {vocab} is not a multiple of the {self.W} ranks (the logits all-gather takes equal blocks)"
            )
        cut = self.column(cur, linear_op(cur), [ranges[self.rank]], kind="vocab")
        how = f"vocab {vocab} by rows + all_gather of the logits"
        per_rank = tuple(f"vocab {fmt_range(r)}" for r in ranges)
        return self._split("lm_head", None, [cur], how, per_rank, [cut], (cur.name, "all_gather"))

    # ------------------------------------------------------------------ MLP
    def mlp(self, closing: fx.Node) -> Optional[Region]:
        """The element-wise MLP ending at ``closing`` (None: not one)."""
        inside: List[fx.Node] = []
        openings: List[fx.Node] = []
        stack, seen = [closing.args[0]], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node):
                continue  # a Python scalar operand
            if n in seen:
                continue
            seen.add(n)
            if linear_op(n) is not None and n not in self.claimed:
                openings.append(n)
            elif is_call(n, *ELEMENTWISE):
                inside.append(n)
                stack.extend(a for a in n.args if isinstance(a, fx.Node))
            elif inside and is_call(
                n,
                operator.getitem,
                aten.split.Tensor,
                aten.split_with_sizes.default,
                aten.chunk.default,
                aten.slice.Tensor,
            ):
                raise NotShardable(
                    f"the MLP into {closing.name} splits one projection ({op_name(n)}): fused "
                    "gate/up projections are not split yet"
                )
            else:
                return None
        if not openings:
            return None
        widths = {features(n)[1] for n in openings}
        if len(widths) != 1:
            raise NotShardable(f"opening linears of different widths {sorted(widths)}")
        inter = widths.pop()
        closing_op = linear_op(closing)
        assert closing_op is not None  # the closing node is a linear
        ranges = split_evenly(inter, self.W, closing_op.align(closing))
        if min(b - a for a, b in ranges) <= 0:
            raise NotShardable(f"intermediate width {inter} is too small for {self.W} ranks")
        rows = ranges[self.rank]
        cuts = [self.column(n, linear_op(n), [rows]) for n in openings] + [
            self.row(closing, linear_op(closing), [rows])
        ]
        nodes = [*openings, *inside, closing]
        self._check_private(nodes, allowed_outside={closing})
        how = f"intermediate {inter}: {len(openings)} column, 1 row + all_reduce"
        per_rank = tuple(f"features {fmt_range(r)}" for r in ranges)
        return self._split("mlp", layer_of(nodes), nodes, how, per_rank, cuts, (closing.name, "all_reduce"))

    def swiglu(self, node: fx.Node) -> Region:
        gate, up, down = node.args[1:4]
        if not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in (gate, up, down)):
            raise NotShardable("swiglu weights are not plain graph tensors")
        biases = [
            node.args[i] if len(node.args) > i else node.kwargs.get(k)
            for i, k in ((4, "gate_bias"), (5, "up_bias"), (6, "down_bias"))
        ]
        if any(b is not None for b in biases):
            raise NotShardable("swiglu with biases is not split yet")
        inter = int(gate.meta["val"].shape[0])
        ranges = split_evenly(inter, self.W)
        rows = ranges[self.rank]
        cut = NodeCut(
            node.name,
            "column+row",
            (
                TensorCut(1, gate.target, 0, (rows,)),
                TensorCut(2, up.target, 0, (rows,)),
                TensorCut(3, down.target, 1, (rows,)),
            ),
        )
        how = f"swiglu intermediate {inter}: gate/up column, down row + all_reduce"
        per_rank = tuple(f"features {fmt_range(r)}" for r in ranges)
        return self._split("mlp", layer_of([node]), [node], how, per_rank, [cut], (node.name, "all_reduce"))


__all__ = ["MlpRegions"]
