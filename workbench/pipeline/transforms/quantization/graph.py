"""What the quantization transforms share: when they apply, and how a graph gets quantized tensors.

A quantize transform rewrites an op (``aten.linear``, ``torch_moe_fused``...) into its quantized
op and gives the graph the tensors that op reads: meta placeholders of the right shape and dtype
(the graph is traced on ``meta`` until ``load_weights``), named as the checkpoint names them
(``<module>.weight``, ``.weight_scale``, ``.input_scale``...), each with a ``TensorBinding`` that says
how ``load_weights`` makes it: a checkpoint tensor as it is, or a declared conversion of checkpoint
(or eager-model) tensors. The placeholder's shape and dtype come from running that same conversion
on meta tensors, so what the graph says and what loading produces cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from ...graph.weights import fake_value, fetch_attr
from ...interface import TransformConfig, TransformInfo, nothing_to_do  # noqa: F401  (re-exported to the quantization family)
from ...matcher import annotate_new_nodes
from ...weights import TensorBinding, record_tensor_binding

aten = torch.ops.aten


def checkpoint_skip_reason(ctx, key: str, algos: Sequence[str]) -> Optional[str]:
    """Why ``key`` (which handles checkpoints quantized as ``algos``) has nothing to do, or None."""
    cfg = ctx.quant_config
    if cfg is None:
        return (
            f"the model has no quantization config (it was not loaded from a quantized checkpoint "
            f"directory): {key} left the graph unchanged"
        )
    if cfg.quant_algo not in algos:
        return (
            f"the checkpoint is {cfg.quant_algo} (from {cfg.source}); {key} handles "
            f"{' / '.join(algos)}: graph left unchanged"
        )
    return None


def scalar_fp32(t: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale stored as [] / [1] (any float dtype) -> fp32 0-d, as the ops take it."""
    if t.numel() != 1:
        raise ValueError(f"expected one per-tensor scale, got shape {tuple(t.shape)}")
    return t.float().reshape(())


def to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass
class GraphTensors:
    """Quantized tensors being given to one graph: each target gets a meta placeholder and a
    binding; ``node(target)`` is its ``get_attr`` (reused when one already reads the target)."""

    gm: fx.GraphModule
    checkpoint: Optional[Mapping[str, torch.Tensor]]  # raw checkpoint tensors by name
    model: Optional[Mapping[str, torch.Tensor]] = None  # eager tensors by graph name
    new_nodes: List[fx.Node] = field(default_factory=list)
    targets: List[str] = field(default_factory=list)

    def source(self, namespace: str, name: str) -> torch.Tensor:
        table = self.checkpoint if namespace == "checkpoint" else self.model
        if table is None or name not in table:
            raise KeyError(f"{namespace} tensor {name!r} not found")
        return table[name]

    def bind(
        self,
        target: str,
        inputs: Sequence[str],
        convert: Optional[Callable] = None,
        *,
        namespace: str = "checkpoint",
        output: Optional[int] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Make ``target`` a meta tensor shaped like ``convert(*inputs)`` and record the binding;
        returns the meta tensor."""
        binding = TensorBinding(tuple(inputs), namespace, convert, tuple(sorted(kwargs.items())), output)
        metas = [to_meta(self.source(namespace, n)) for n in inputs]
        like = convert(*metas, **kwargs) if convert is not None else metas[0]
        like = like[output] if output is not None else like
        set_meta_attr(self.gm, target, to_meta(like))
        record_tensor_binding(self.gm, target, binding)
        self.targets.append(target)
        return like

    def node(self, target: str, before: fx.Node) -> fx.Node:
        """The ``get_attr`` node reading ``target`` (an existing one, its value refreshed, or a new one)."""
        value = fetch_attr(self.gm, target)
        existing = [n for n in self.gm.graph.find_nodes(op="get_attr") if n.target == target]
        if existing:
            existing[0].meta["val"] = fake_value(self.gm, value)
            return existing[0]
        with self.gm.graph.inserting_before(before):
            n = self.gm.graph.get_attr(target)
        n.meta["val"] = fake_value(self.gm, value)
        self.new_nodes.append(n)
        return n


def set_meta_attr(gm: fx.GraphModule, target: str, meta: torch.Tensor) -> None:
    """Register ``meta`` as buffer ``target`` of ``gm``, replacing a parameter or buffer of that name
    (buffers: quantized tensors are not trainable, and they bind by name like any tensor)."""
    owner_path, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    if leaf in owner.__dict__:
        delattr(owner, leaf)
    owner.register_buffer(leaf, meta)


def attr_users_elsewhere(gm: fx.GraphModule, target: str, node: fx.Node) -> List[fx.Node]:
    """Nodes other than ``node`` reading attribute ``target`` (a tied weight, say)."""
    return [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == target for u in n.users if u is not node]


def replace_node(
    gm: fx.GraphModule,
    node: fx.Node,
    op: Any,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    tensors: GraphTensors,
    replaced: Iterable[fx.Node] = (),
) -> fx.Node:
    """Insert ``op(*args, **kwargs)`` before ``node``, reroute ``node``'s users to it, erase ``node``
    (and ``replaced`` nodes left without users); provenance and fake values as every rewrite has."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, tuple(args), dict(kwargs))
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    gone = [n for n in replaced if not n._erased and not n.users]
    for n in gone:
        gm.graph.erase_node(n)
    annotate_new_nodes(gm, tensors.new_nodes + [new], [node.name] + [n.name for n in gone], anchor=node)
    tensors.new_nodes.clear()
    return new


def drop_unread_attrs(gm: fx.GraphModule, targets: Iterable[str]) -> List[str]:
    """Remove attributes ``targets`` that no ``get_attr`` node reads any more (their get_attr nodes
    without users are erased first); returns the removed names."""
    wanted = set(targets)
    for n in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in wanted and not n.users]:
        gm.graph.erase_node(n)
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    removed = []
    for target in sorted(wanted - read):
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if hasattr(owner, leaf):
            delattr(owner, leaf)
            removed.append(target)
    return removed


def get_attr_target(node: Any) -> Optional[str]:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


class QuantizeFromConfigConfig(TransformConfig):
    """The config of every ``quantize_*`` transform that reads the checkpoint's quant config."""

    exclude_modules: List[str] = Field(
        default_factory=list,
        description="Module patterns (fnmatch, checkpoint names such as 'model.layers.0.mlp.*') to leave "
        "unquantized on top of the checkpoint's own exclude list: they run on the dequantized weights.",
    )


__all__ = [
    "checkpoint_skip_reason",
    "nothing_to_do",
    "scalar_fp32",
    "GraphTensors",
    "set_meta_attr",
    "attr_users_elsewhere",
    "replace_node",
    "drop_unread_attrs",
    "get_attr_target",
    "to_meta",
    "QuantizeFromConfigConfig",
]
