"""Rewrite the sharding-hint ops of a graph for one rank (``apply_sharding_hints``).

A sharding-aware model (``models/custom/modeling_*_ir.py``) exports ``torch.ops.workbench.torch_hint_*``
nodes that say how each op splits (``ops/sharding_hints``). Here each hinted node is rewritten on
its own, with no region search:

=======================  ==========================================================================
hinted node              sharded for rank r of W (``layer_type`` selected)  /  not sharded
=======================  ==========================================================================
linear colwise           weight rows ``[r*N/W, (r+1)*N/W)`` (bias too; of each part with
                         ``output_sizes``) -> ``aten.linear``
linear rowwise           weight columns ``[r*K/W, ...)``, bias on rank 0 only -> ``aten.linear``
linear none              -> ``aten.linear`` (replicated)
split_with_sizes         sizes / W when ``shardable`` -> ``aten.split_with_sizes``
view                     ``shape[tp_scaled_dim]`` / W -> ``aten.reshape``
all_reduce marker        -> ``torch_dist_all_reduce``            /  removed (identity)
all_gather marker        -> ``torch_dist_all_gather`` along dim  /  removed
moe ep                   experts ``split_evenly(E, W)[r]``, ids remapped by ``torch_moe_local_experts``
moe tp                   each expert's intermediate ``[r*I/W, ...)``: gate and up rows, down columns
=======================  ==========================================================================

Every hinted node is lowered to the plain op even when it is not sharded (a layer type outside
``shard_layers``, or world size 1), so later transforms (fusion, quantization) see ordinary aten
linears. Weights are cut with ``apply._cut_tensor`` (meta tensors of the local shape plus a binding
``load_weights`` follows), the same mechanism ``sharding_transform_executor`` uses, so a hinted and a
detected rank hold the same bytes for the same split.

A size that does not divide by the world size (heads, vocab, intermediate) is refused with the node
and the sizes named (``HintError``): the hints are unconditional, so there is no silent fallback.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from ...graph.weights import fetch_attr
from ...snapshot import REPLACES_KEY
from .apply import SHARDING_META, _cut_tensor
from .plan import TensorCut, split_evenly

aten, wb = torch.ops.aten, torch.ops.workbench


class HintError(ValueError):
    """A hinted node cannot be split for this world size (the message names the node and sizes)."""


@dataclass(frozen=True)
class HintTarget:
    """Where this graph is sharded for, and which layer types are."""

    world_size: int
    rank: int
    group_name: str
    shard_layers: Optional[frozenset] = None  # None: every layer type

    def shards(self, layer_type: str) -> bool:
        return self.world_size > 1 and (self.shard_layers is None or layer_type in self.shard_layers)


def hint_ops() -> Dict[Any, str]:
    """The hinted op overloads -> their short kind."""
    return {
        wb.torch_hint_linear.default: "linear",
        wb.torch_hint_split_with_sizes.default: "split",
        wb.torch_hint_view.default: "view",
        wb.torch_hint_all_reduce.default: "all_reduce",
        wb.torch_hint_all_gather.default: "all_gather",
        wb.torch_hint_moe.default: "moe",
    }


def bound_args(node: fx.Node) -> Dict[str, Any]:
    """The node's arguments by schema name, defaults filled in (positional or keyword alike)."""
    out: Dict[str, Any] = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _even(node: fx.Node, what: str, n: int, W: int, unit: int = 1) -> int:
    """``n / W``, refused unless it is a whole number of ``unit``s."""
    if n % W or (n // W) % unit:
        raise HintError(
            f"{node.name}: {what} {n} does not split into {W} equal parts of whole {unit}-element units "
            f"(world size must divide it; compatible world sizes: "
            f"{[w for w in range(1, n + 1) if n % w == 0 and (n // w) % unit == 0][:8]})"
        )
    return n // W


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, target: HintTarget):
        self.gm, self.t = gm, target
        self.readers = Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")
        self.counts: Counter = Counter()
        self.bytes_whole = 0
        self.bytes_local = 0
        self.by_layer: Counter = Counter()

    # ------------------------------------------------------------------ helpers
    def replace(self, old: fx.Node, target, args: tuple, kwargs: Optional[dict] = None, note: str = "") -> fx.Node:
        with self.gm.graph.inserting_before(old):
            new = self.gm.graph.call_function(target, args, kwargs or {})
        new.meta.update({k: v for k, v in old.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        old.replace_all_uses_with(new)
        self.gm.graph.erase_node(old)
        new.meta["hint_replaces"] = old.name
        if note:
            new.meta[SHARDING_META] = note
        return new

    def cut(self, node: fx.Node, index: int, dim: int, ranges, zero: bool = False) -> None:
        attr = node.args[index]
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            raise HintError(f"{node.name}: argument {index} is computed, not a weight: it cannot be cut")
        whole = fetch_attr(self.gm, attr.target)
        nbytes = whole.numel() * whole.element_size()
        keep = sum(b - a for a, b in ranges) / whole.shape[dim]
        self.bytes_whole += nbytes
        self.bytes_local += int(nbytes * keep)
        _cut_tensor(self.gm, node, TensorCut(index, attr.target, dim, tuple(ranges), zero), self.readers)
        self.counts["tensors_cut"] += 1

    def shape_of(self, node: fx.Node, index: int) -> Sequence[int]:
        attr = node.args[index]
        if isinstance(attr, fx.Node) and attr.op == "get_attr":
            return tuple(fetch_attr(self.gm, attr.target).shape)
        return tuple(attr.meta["val"].shape)

    # ------------------------------------------------------------------ per op
    def linear(self, node: fx.Node, a: Dict[str, Any]) -> None:
        shard = self.t.shards(a["layer_type"]) and a["tp_mode"] != "none"
        W, r = self.t.world_size, self.t.rank
        new = self.replace(node, aten.linear.default, (a["x"], a["weight"], a["bias"]))
        if not shard:
            return
        n_out, k_in = self.shape_of(new, 1)[:2]
        if a["tp_mode"] == "colwise":
            parts = list(a["output_sizes"] or [n_out])
            if sum(parts) != n_out:
                raise HintError(f"{node.name}: output_sizes {parts} do not add up to the {n_out} output features")
            rows, start = [], 0
            for part in parts:  # a fused projection: this rank's slice of each part, in order
                local = _even(new, "output features", part, W, a["tp_min_local_shape"])
                rows.append((start + r * local, start + (r + 1) * local))
                start += part
            self.cut(new, 1, 0, rows)
            if a["bias"] is not None:
                self.cut(new, 2, 0, rows)
            held = ", ".join(f"{x}-{y - 1}" for x, y in rows)
            new.meta[SHARDING_META] = f"column features {held} ({a['layer_type']})"
        else:
            local = _even(new, "input features", k_in, W)
            self.cut(new, 1, 1, ((r * local, (r + 1) * local),))
            if a["bias"] is not None:
                self.cut(new, 2, 0, ((0, n_out),), zero=r != 0)
            new.meta[SHARDING_META] = f"row features {r * local}-{(r + 1) * local - 1} ({a['layer_type']})"
        self.counts[f"linear_{a['tp_mode']}"] += 1
        self.by_layer[a["layer_type"]] += 1

    def split(self, node: fx.Node, a: Dict[str, Any]) -> None:
        sizes = list(a["split_sizes"])
        if a["shardable"] and self.t.shards(a["layer_type"]):
            sizes = [_even(node, "split size", s, self.t.world_size) for s in sizes]
            self.counts["split_sizes_scaled"] += 1
        self.replace(node, aten.split_with_sizes.default, (a["x"], sizes, a["dim"]))

    def view(self, node: fx.Node, a: Dict[str, Any]) -> None:
        shape, d = list(a["shape"]), a["tp_scaled_dim"]
        if d >= 0 and self.t.shards(a["layer_type"]):
            if not isinstance(shape[d], int) or shape[d] < 0:
                raise HintError(f"{node.name}: tp_scaled_dim {d} of shape {shape} is not a literal size")
            shape[d] = _even(node, f"view dim {d}", shape[d], self.t.world_size)
            self.counts["view_sizes_scaled"] += 1
        self.replace(node, aten.reshape.default, (a["x"], shape))

    def collective(self, node: fx.Node, a: Dict[str, Any], kind: str, target, args: tuple) -> None:
        """``node`` (a hinted collective ``kind``) as ``target(*args)`` where its layer is sharded;
        elsewhere it is dropped (its input passes through: one rank holds everything)."""
        if not self.t.shards(a["layer_type"]):
            node.replace_all_uses_with(a["x"])
            self.gm.graph.erase_node(node)
            return
        self.replace(node, target, args, note=f"{kind} over {self.t.world_size} ranks ({a['layer_type']})")
        self.counts[kind] += 1

    def all_reduce(self, node: fx.Node, a: Dict[str, Any]) -> None:
        self.collective(node, a, "all_reduce", wb.torch_dist_all_reduce.default, (a["x"], self.t.group_name))

    def all_gather(self, node: fx.Node, a: Dict[str, Any]) -> None:
        args = (a["x"], a["dim"], self.t.world_size, self.t.group_name)
        self.collective(node, a, "all_gather", wb.torch_dist_all_gather.default, args)

    def moe(self, node: fx.Node, a: Dict[str, Any]) -> None:
        W, r = self.t.world_size, self.t.rank
        mode = a["moe_mode"] if self.t.shards(a["layer_type"]) else "none"
        ids = a["selected_experts"]
        experts, two_inter = self.shape_of(node, 3)[:2]
        if mode == "ep":
            if experts < W:
                raise HintError(f"{node.name}: {experts} experts are fewer than the {W} ranks (use moe_mode 'tp')")
            e0, e1 = split_evenly(experts, W)[r]
            with self.gm.graph.inserting_before(node):
                ids = self.gm.graph.call_function(wb.torch_moe_local_experts.default, (ids, e0, e1 - e0))
            ids.meta[SHARDING_META] = f"expert ids -> local {e0}..{e1 - 1} (else -1)"
        args = (a["x"], ids, a["routing_weights"], a["w1_w3_stacked"], a["w2_stacked"])
        new = self.replace(node, wb.torch_moe_fused.default, args, {"act_fn": a["act_fn"]})
        if mode == "ep":
            self.cut(new, 3, 0, ((e0, e1),))
            self.cut(new, 4, 0, ((e0, e1),))
            new.meta[SHARDING_META] = f"experts {e0}-{e1 - 1} (EP)"
        elif mode == "tp":
            inter = two_inter // 2
            local = _even(new, "expert intermediate", inter, W)
            a0, a1 = r * local, (r + 1) * local
            self.cut(new, 3, 1, ((a0, a1), (inter + a0, inter + a1)))  # gate rows, then up rows
            self.cut(new, 4, 2, ((a0, a1),))
            new.meta[SHARDING_META] = f"expert features {a0}-{a1 - 1} (TP)"
        if mode != "none":
            self.counts[f"moe_{mode}"] += 1
            self.by_layer[a["layer_type"]] += 1

    def run(self) -> Dict[str, Any]:
        kinds = hint_ops()
        for node in list(self.gm.graph.nodes):
            kind = kinds.get(node.target) if node.op == "call_function" else None
            if kind is None:
                continue
            self.counts[f"hinted_{kind}"] += 1
            before = set(self.gm.graph.nodes)
            getattr(self, kind)(node, bound_args(node))
            for n in self.gm.graph.nodes:  # provenance; fake values come from run_shape_prop afterwards
                if n not in before:
                    n.meta[REPLACES_KEY] = [n.meta.pop("hint_replaces", node.name)]
        self.gm.graph.eliminate_dead_code()
        return {
            **dict(self.counts),
            "sharded_nodes_by_layer_type": dict(self.by_layer),
            "sharded_weight_bytes": self.bytes_whole,
            "sharded_weight_bytes_this_rank": self.bytes_local,
        }


def hinted_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    kinds = hint_ops()
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in kinds]


def apply_hints(gm: fx.GraphModule, target: HintTarget) -> Dict[str, Any]:
    """Rewrite every hinted node of ``gm`` for ``target`` (see the module docstring); returns counts."""
    return _Rewriter(gm, target).run()


__all__ = ["HintError", "HintTarget", "apply_hints", "hinted_nodes", "bound_args", "hint_ops"]
