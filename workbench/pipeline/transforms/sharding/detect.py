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
"""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ....ops.library import op_traits
from ...graph.utils import op_name
from .linear_ops import LinearOp, features, linear_op
from .plan import NodeCut, Range, Region, ShardingPlan, TensorCut, fmt_range, split_evenly, width

aten, wb = torch.ops.aten, torch.ops.workbench

# Ops between a projection and attention that act on each head alone (the head dim is untouched).
PASS_THROUGH = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.alias.default,
}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Element-wise ops an MLP may apply between its opening and closing linears.
ELEMENTWISE = {
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.pow.Tensor_Scalar,
    aten.to.dtype,
    aten._to_copy.default,
    aten.clamp.default,
}
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
_LAYER = re.compile(r"layers[._](\d+)[._]")


class NotShardable(Exception):
    """A region the sharder recognised but cannot split; the message is the plan's reason."""


def _is(node: object, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _layer_of(nodes: Iterable[fx.Node]) -> Optional[int]:
    for n in nodes:
        for a in [n, *n.all_input_nodes]:
            m = _LAYER.search(str(a.target) + "." if a.op == "get_attr" else "")
            if m:
                return int(m.group(1))
    return None


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _arg(node: fx.Node, index) -> fx.Node:
    """A node argument by position, or by keyword (``sinks``)."""
    return node.args[index] if isinstance(index, int) else node.kwargs[index]


class Detector:
    def __init__(
        self,
        gm: fx.GraphModule,
        world_size: int,
        rank: int,
        group_name: str,
        dims: Sequence[str] = ("tp", "ep"),
        layers: Optional[Sequence[str]] = None,
    ):
        self.gm, self.W, self.rank, self.group = gm, world_size, rank, group_name
        self.dims, self.layers = set(dims), set(layers) if layers is not None else None
        self.claimed: Set[fx.Node] = set()
        self.regions: List[Region] = []
        self.by_name: Dict[str, fx.Node] = {n.name: n for n in gm.graph.nodes}  # detection never edits the graph

    def wanted(self, kind: str) -> bool:
        dim = "ep" if kind == "moe" else "tp"
        return dim in self.dims and (self.layers is None or kind in self.layers)

    # ------------------------------------------------------------------ cuts
    def column(self, node: fx.Node, rule: Optional[LinearOp], rows: Sequence[Range], kind: str = "column") -> NodeCut:
        assert rule is not None  # callers pass linear_op(node) of a node known to be a linear
        tensors = [TensorCut(w.index, node.args[w.index].target, 0, tuple(rows)) for w in rule.weights]
        bias = rule.bias(node)
        if bias is not None:
            assert rule.bias_index is not None  # a bias is found only at bias_index
            tensors.append(TensorCut(rule.bias_index, bias.target, 0, tuple(rows)))
        return NodeCut(node.name, kind, tuple(tensors))

    def row(self, node: fx.Node, rule: Optional[LinearOp], cols: Sequence[Range]) -> NodeCut:
        assert rule is not None  # callers pass linear_op(node) of a node known to be a linear
        align = rule.align(node)
        tensors = []
        for w in rule.weights:
            f: Fraction = w.per_feature(node)
            for a, b in cols:
                if a % align or (b % align and b != features(node)[0]):
                    raise NotShardable(
                        f"{node.name}: input features {a}-{b} do not fall on its {align}-element quantization groups"
                    )
            tensors.append(
                TensorCut(w.index, node.args[w.index].target, 1, tuple((int(a * f), int(b * f)) for a, b in cols))
            )
        bias = rule.bias(node)
        if bias is not None:
            assert rule.bias_index is not None  # a bias is found only at bias_index
            n = features(node)[1]
            tensors.append(TensorCut(rule.bias_index, bias.target, 0, ((0, n),), zero=self.rank != 0))
        return NodeCut(node.name, "row", tuple(tensors))

    def _split(
        self,
        kind: str,
        layer: Optional[int],
        nodes: Sequence[fx.Node],
        how: str,
        per_rank: Tuple[str, ...],
        cuts: Sequence[NodeCut],
        collective: Tuple[str, str],
        **more: Any,
    ) -> Region:
        """The region of ``nodes`` split by ``cuts``, its bytes (whole, this rank's) counted from them."""
        whole, local = self.bytes_of(cuts, nodes)
        return Region(
            kind,
            layer,
            tuple(n.name for n in nodes),
            True,
            how,
            per_rank,
            tuple(cuts),
            collective=collective,
            global_bytes=whole,
            local_bytes=local,
            **more,
        )

    def bytes_of(self, cuts: Sequence[NodeCut], whole_nodes: Sequence[fx.Node]) -> Tuple[int, int]:
        """(whole, local) bytes of the get_attr tensors the cut nodes read."""
        by_name = {n.name: n for n in whole_nodes}
        whole = local = 0
        for cut in cuts:
            node = by_name[cut.node]
            for t in cut.tensors:
                v = _arg(node, t.arg_index).meta.get("val")
                if not isinstance(v, torch.Tensor):
                    continue
                whole += v.numel() * v.element_size()
                frac = width(t.ranges) / v.shape[t.dim]
                local += int(v.numel() * v.element_size() * frac)
        return whole, local

    # ------------------------------------------------------------------ attention
    def _back_to_linear(self, start: fx.Node, path: List[fx.Node], heads: int) -> fx.Node:
        """The one linear ``start`` (a Q/K/V input of attention) comes from, walking back over ops
        that act on each head alone; they are appended to ``path``. Partial rotary (slice the head
        dim, rotate a part, concatenate) and casts are per-head; an operand without the head axis
        (cos/sin tables) is shared by all heads and not walked."""
        linears: Set[fx.Node] = set()
        stack, seen = [start], set()
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if linear_op(cur) is not None:
                linears.add(cur)
                continue
            path.append(cur)
            if _is(cur, *PASS_THROUGH) or (_is(cur, aten.slice.Tensor) and self._trailing_dim(cur, cur.args[1])):
                stack.append(cur.args[0])
            elif _is(cur, aten.cat.default, aten.stack.default) and self._trailing_dim(
                cur, cur.args[1] if len(cur.args) > 1 else 0
            ):
                stack.extend(cur.args[0])
            elif (_is(cur, aten.flatten.using_ints) and self._trailing_dim(cur.args[0], cur.args[1])) or (
                _is(cur, aten.unsqueeze.default) and self._trailing_dim(cur, cur.args[1])
            ):
                stack.append(cur.args[0])
            elif (
                _is(cur, operator.getitem)
                and _is(cur.args[0], aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
                and self._trailing_dim(cur.args[0].args[0], cur.args[0].args[2] if len(cur.args[0].args) > 2 else 0)
            ):
                path.append(cur.args[0])
                stack.append(cur.args[0].args[0])
            elif (
                _is(cur, operator.getitem)
                and isinstance(cur.args[0], fx.Node)
                and op_name(cur.args[0]).startswith("workbench.torch_rope")
            ):
                rope = cur.args[0]
                path.append(rope)
                seen.add(rope)
                stack.append(rope.args[cur.args[1]])
            elif getattr(op_traits(cur), "norm", None) is not None and self._per_head(cur):
                stack.append(cur.args[0])
            elif _is(cur, aten.type_as.default):
                stack.append(cur.args[0])
            elif _is(cur, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.div.Tensor):
                for a in cur.args:
                    if isinstance(a, fx.Node) and self._has_heads(a, heads):
                        stack.append(a)
            else:
                what = op_name(cur) if isinstance(cur, fx.Node) else type(cur).__name__
                raise NotShardable(f"{start.name} does not come from a linear through per-head ops (found {what})")
        if len(linears) != 1:
            raise NotShardable(f"{start.name} comes from {len(linears)} projections, not one")
        path[:] = list(dict.fromkeys(path))
        return linears.pop()

    @staticmethod
    def _trailing_dim(node: fx.Node, dim: int) -> bool:
        """``dim`` of ``node``'s value (or its input's, for ops that add a dim) lies after the
        batch, sequence and head axes (dims 0-2 in either bsnd or bnsd)."""
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return False
        return (dim if dim >= 0 else dim + v.dim()) >= 3

    @staticmethod
    def _has_heads(node: fx.Node, heads: int) -> bool:
        """Whether ``node`` carries the head axis (size ``heads`` at dim 1 or 2 of a 4-D value, or a
        flat projection output); broadcast operands (size 1 there) do not."""
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return False
        if v.dim() >= 4:
            return any(isinstance(d, int) and d == heads for d in (v.shape[1], v.shape[2]))
        return v.dim() == 3 and isinstance(v.shape[-1], int) and v.shape[-1] % heads == 0 and v.shape[-1] > heads

    @staticmethod
    def _per_head(norm: fx.Node) -> bool:
        x = norm.args[0].meta.get("val")
        w = norm.args[1] if len(norm.args) > 1 and isinstance(norm.args[1], fx.Node) else None
        wv = w.meta.get("val") if w is not None else None
        return x is not None and x.dim() == 4 and (wv is None or wv.numel() == x.shape[-1])

    def head_ranges(self, heads: int, kv_heads: int) -> List[Tuple[Range, Range]]:
        """(query heads, KV heads) per rank."""
        W = self.W
        if heads % kv_heads:
            raise NotShardable(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        group = heads // kv_heads
        if kv_heads >= W:
            return [((a * group, b * group), (a, b)) for a, b in split_evenly(kv_heads, W)]
        if W % kv_heads:
            raise NotShardable(
                f"{kv_heads} KV heads cannot be copied evenly to {W} ranks (world size must be a "
                f"multiple of the KV heads, or at most {kv_heads})"
            )
        per_kv = W // kv_heads
        if group < per_kv:
            raise NotShardable(f"{heads} query heads are fewer than the {W} ranks")
        out = []
        for r in range(W):
            kv, part = divmod(r, per_kv)
            a, b = split_evenly(group, per_kv)[part]
            out.append(((kv * group + a, kv * group + b), (kv, kv + 1)))
        return out

    def attention(self, attn: fx.Node) -> Region:
        nodes: List[fx.Node] = [attn]
        if attn.kwargs.get("layout", "bsnd") != "bsnd":
            raise NotShardable(f"layout {attn.kwargs.get('layout')} (only bsnd attention is split)")
        q, k, v = attn.args[:3]
        paths: Dict[str, List[fx.Node]] = {name: [] for name in "qkv"}
        lins = {
            name: self._back_to_linear(x, paths[name], int(x.meta["val"].shape[2])) for name, x in zip("qkv", (q, k, v))
        }
        if len({lins["q"], lins["k"], lins["v"]}) < 3:
            raise NotShardable("Q, K and V come from one fused projection (split after it): not split yet")
        out_path: List[fx.Node] = []
        cur = attn
        while len(cur.users) == 1 and _is(next(iter(cur.users)), *PASS_THROUGH):
            cur = next(iter(cur.users))
            out_path.append(cur)
        users = list(cur.users)
        if len(users) != 1 or linear_op(users[0]) is None or users[0].args[0] is not cur:
            raise NotShardable(
                f"the attention output does not go straight into one linear "
                f"(users: {', '.join(op_name(u) for u in users)})"
            )
        o_lin = users[0]
        qv, kv_, vv = (x.meta.get("val") for x in (q, k, v))
        heads, kv_heads, head_dim, v_dim = (int(qv.shape[2]), int(kv_.shape[2]), int(qv.shape[3]), int(vv.shape[3]))
        ranges = self.head_ranges(heads, kv_heads)
        (h0, h1), (g0, g1) = ranges[self.rank]
        rules = {x: linear_op(lins[x]) for x in "qkv"}
        cuts = [
            self.column(lins["q"], rules["q"], [(h0 * head_dim, h1 * head_dim)]),
            self.column(lins["k"], rules["k"], [(g0 * head_dim, g1 * head_dim)]),
            self.column(lins["v"], rules["v"], [(g0 * v_dim, g1 * v_dim)]),
            self.row(o_lin, linear_op(o_lin), [(h0 * v_dim, h1 * v_dim)]),
        ]
        sinks = attn.kwargs.get("sinks")
        if isinstance(sinks, fx.Node):  # one learned logit per query head: cut with the heads
            if sinks.op != "get_attr":
                raise NotShardable("attention sinks are computed, not a weight: not split")
            cuts.append(NodeCut(attn.name, "column", (TensorCut("sinks", sinks.target, 0, ((h0, h1),)),)))
        if attn.kwargs.get("alibi_slopes") is not None:  # a real constant the pattern stage made, not a weight
            raise NotShardable("ALiBi slopes (a per-head constant of the graph) are not split yet")
        fixes = []
        for name, nheads, local in (("q", heads, h1 - h0), ("k", kv_heads, g1 - g0), ("v", kv_heads, g1 - g0)):
            fixes += self._fix_heads(paths[name], nheads, local, last=False)
        fixes += self._fix_heads(out_path, heads * v_dim, (h1 - h0) * v_dim, last=True)
        nodes += [*lins.values(), *paths["q"], *paths["k"], *paths["v"], *out_path, o_lin]
        self._check_private(nodes, allowed_outside={o_lin})
        per_rank = tuple(f"q heads {fmt_range(q_)}, kv heads {fmt_range(k_)}" for q_, k_ in ranges)
        how = f"{heads} query / {kv_heads} KV heads by head: q/k/v column, o row + all_reduce" + (
            " (KV heads copied)" if kv_heads < self.W else ""
        )
        collective = (o_lin.name, "all_reduce")
        return self._split("mha", _layer_of(nodes), nodes, how, per_rank, cuts, collective, shape_fixes=tuple(fixes))

    @staticmethod
    def _fix_heads(path: Sequence[fx.Node], whole: int, local: int, last: bool) -> List[Tuple[str, int, int]]:
        """Literal head counts in view/reshape shapes (``-1`` needs nothing): the heads dim is the
        one before the head dim (``[b, s, H, D]``), or the last one after the heads are merged."""
        fixes = []
        for n in path:
            if not _is(n, *RESHAPES):
                continue
            shape = list(n.args[1])
            i = len(shape) - 1 if last else len(shape) - 2
            if i >= 0 and isinstance(shape[i], int) and shape[i] == whole:
                fixes.append((n.name, i, local))
        return fixes

    def _check_private(self, nodes: Sequence[fx.Node], allowed_outside: Set[fx.Node]) -> None:
        inside = set(nodes)
        for n in nodes:
            if n in allowed_outside:
                continue
            outside = [u for u in n.users if u not in inside]
            if outside:
                raise NotShardable(f"{n.name} is also read outside the region (by {outside[0].name})")

    # ------------------------------------------------------------------ MoE
    def moe(self, node: fx.Node) -> Region:
        layer = _layer_of([node])
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
            whole = sum(_nbytes(w) for lst in node.args[3:6] for w in lst)
            local = sum(_nbytes(w) for lst in node.args[3:6] for w in lst[e0:e1])
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
        while isinstance(cur, fx.Node) and linear_op(cur) is None and _is(cur, *PASS_THROUGH, *ELEMENTWISE):
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
            elif _is(n, *ELEMENTWISE):
                inside.append(n)
                stack.extend(a for a in n.args if isinstance(a, fx.Node))
            elif inside and _is(
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
        return self._split("mlp", _layer_of(nodes), nodes, how, per_rank, cuts, (closing.name, "all_reduce"))

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
        return self._split("mlp", _layer_of([node]), [node], how, per_rank, [cut], (node.name, "all_reduce"))

    # ------------------------------------------------------------------ driver
    def _add(self, kind: str, anchor: fx.Node, build) -> None:
        if not self.wanted(kind):
            self.regions.append(
                Region(
                    kind,
                    _layer_of([anchor]),
                    (anchor.name,),
                    False,
                    "not selected (detect_sharding.sharding_dims / shard_layers)",
                )
            )
            return
        try:
            region = build()
        except NotShardable as e:
            self.regions.append(Region(kind, _layer_of([anchor]), (anchor.name,), False, str(e)))
            return
        if region is None:
            return
        self.regions.append(region)
        self.claimed.update(self.by_name[x] for x in region.nodes)

    def detect(self, vocab: int) -> ShardingPlan:
        g = self.gm.graph
        for n in list(g.nodes):
            if _is(n, wb.torch_attention.default):
                self._add("mha", n, lambda n=n: self.attention(n))
        for n in list(g.nodes):
            if _is(n, wb.torch_moe_fused.default, wb.torch_moe.default):
                self._add("moe", n, lambda n=n: self.moe(n))
        out = next(n for n in g.nodes if n.op == "output")
        self._add("lm_head", out, lambda: self.lm_head(vocab))
        for n in list(g.nodes):
            if n in self.claimed:
                continue
            if _is(n, wb.torch_swiglu_mlp.default):
                self._add("mlp", n, lambda n=n: self.swiglu(n))
            elif linear_op(n) is not None:
                self._add("mlp", n, lambda n=n: self.mlp(n))
        for n in g.nodes:
            name = op_name(n)
            if n.op == "call_function" and any(name.startswith(f"workbench.{m}") for m in UNSHARDED_MIXERS):
                self.regions.append(
                    Region(
                        name.split(".")[1],
                        _layer_of([n]),
                        (n.name,),
                        False,
                        "no sharding rule for this op: the layer runs whole on every rank",
                    )
                )
            elif _is(n, aten.embedding.default, wb.torch_int8_embedding.default):
                self.regions.append(
                    Region(
                        "embedding",
                        None,
                        (n.name,),
                        False,
                        "replicated: every rank holds the whole table (no vocab-parallel embedding)",
                        global_bytes=sum(_nbytes(a) for a in n.all_input_nodes if a.op == "get_attr"),
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


__all__ = ["detect_plan", "Detector", "NotShardable", "PASS_THROUGH", "ELEMENTWISE"]
