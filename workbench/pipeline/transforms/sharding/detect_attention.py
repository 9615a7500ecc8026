"""The ``mha`` region of sharding detection: a ``torch_attention`` node (bsnd) split by heads.

Q, K and V are traced back through per-head ops (view/reshape/transpose, the RoPE op, per-head norms,
casts, partial rotary's slice / cat) to their linears, the output forward through reshapes to the O
linear. Heads go to ranks whole: with ``G >= W`` KV heads each rank takes a contiguous block of KV
heads and their query groups (9 query / 3 KV heads on 2 ranks: 6+3 query heads, 2+1 KV heads); with
fewer KV heads than ranks (``W % G == 0``) each KV head is copied to ``W / G`` ranks that split its
query group. Q/K/V column, O row + all-reduce; literal head counts in the reshapes between them are
rewritten to this rank's (``shape_fixes``).
"""

from __future__ import annotations

import operator
from typing import Dict, List, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ....ops.library import op_traits
from ...graph.utils import op_name
from .detect_cuts import PASS_THROUGH, RESHAPES, NotShardable, RegionCutter, is_call, layer_of
from .linear_ops import linear_op
from .plan import NodeCut, Range, Region, TensorCut, fmt_range, split_evenly

aten = torch.ops.aten


class AttentionRegions(RegionCutter):
    """Finds and cuts the attention regions (``attention``)."""

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
            if is_call(cur, *PASS_THROUGH) or (
                is_call(cur, aten.slice.Tensor) and self._trailing_dim(cur, cur.args[1])
            ):
                stack.append(cur.args[0])
            elif is_call(cur, aten.cat.default, aten.stack.default) and self._trailing_dim(
                cur, cur.args[1] if len(cur.args) > 1 else 0
            ):
                stack.extend(cur.args[0])
            elif (is_call(cur, aten.flatten.using_ints) and self._trailing_dim(cur.args[0], cur.args[1])) or (
                is_call(cur, aten.unsqueeze.default) and self._trailing_dim(cur, cur.args[1])
            ):
                stack.append(cur.args[0])
            elif (
                is_call(cur, operator.getitem)
                and is_call(cur.args[0], aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
                and self._trailing_dim(cur.args[0].args[0], cur.args[0].args[2] if len(cur.args[0].args) > 2 else 0)
            ):
                path.append(cur.args[0])
                stack.append(cur.args[0].args[0])
            elif (
                is_call(cur, operator.getitem)
                and isinstance(cur.args[0], fx.Node)
                and op_name(cur.args[0]).startswith("workbench.torch_rope")
            ):
                rope = cur.args[0]
                path.append(rope)
                seen.add(rope)
                stack.append(rope.args[cur.args[1]])
            elif getattr(op_traits(cur), "norm", None) is not None and self._per_head(cur):
                stack.append(cur.args[0])
            elif is_call(cur, aten.type_as.default):
                stack.append(cur.args[0])
            elif is_call(cur, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.div.Tensor):
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
        while len(cur.users) == 1 and is_call(next(iter(cur.users)), *PASS_THROUGH):
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
        return self._split("mha", layer_of(nodes), nodes, how, per_rank, cuts, collective, shape_fixes=tuple(fixes))

    @staticmethod
    def _fix_heads(path: Sequence[fx.Node], whole: int, local: int, last: bool) -> List[Tuple[str, int, int]]:
        """Literal head counts in view/reshape shapes (``-1`` needs nothing): the heads dim is the
        one before the head dim (``[b, s, H, D]``), or the last one after the heads are merged."""
        fixes = []
        for n in path:
            if not is_call(n, *RESHAPES):
                continue
            shape = list(n.args[1])
            i = len(shape) - 1 if last else len(shape) - 2
            if i >= 0 and isinstance(shape[i], int) and shape[i] == whole:
                fixes.append((n.name, i, local))
        return fixes


__all__ = ["AttentionRegions"]
