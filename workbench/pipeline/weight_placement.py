"""Binding a graph to its real weights for good (stage ``weight_load``): ``place_weights``.

Every meta tensor of the graph module is replaced by the real one ``weights.WeightResolver`` gives
(shared with the eager model when it already lives on the pipeline device, copied once when not);
the device arguments export baked into nodes (``device=meta``, or the device it traced on) are
retargeted, and the nodes' fake values move to the device, so that shape propagation and every
later transform see one device. ``Placement`` reports what was shared, copied or made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .graph.utils import size_expr, symbolic_fake_mode
from .weights import TRACE_DEVICE_KEY, WeightResolver, tensor_attributes


def _retarget(value: Any, old: str, new: torch.device) -> Any:
    if isinstance(value, torch.device) and value.type == old:
        return new
    return value


def retarget_node_devices(gm: fx.GraphModule, old: str, new: torch.device) -> int:
    """Rewrite ``device=<old>`` arguments of graph nodes (factories, ``_to_copy``...) to ``new``.

    Returns how many nodes changed. Export bakes the trace device into every tensor factory call;
    without this a graph traced on meta would keep creating meta tensors on the real device.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: _retarget(a, old, new))
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            n += 1
    if n:
        gm.recompile()
    return n


def retarget_values(gm: fx.GraphModule, device: torch.device) -> int:
    """Move every node's fake value (``meta['val']``, tuples included) from another device to
    ``device``, sizes and strides kept: what a shape propagation after binding would give, at a
    fraction of its cost (one ``to`` per value instead of re-running every op). Returns how many
    nodes changed. New dicts, so snapshots that share the old ones keep their meta values."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    n = 0
    if mode is None:
        return n

    # One fresh fake tensor per description (sizes, strides, dtype), shared by the values that
    # have it -- the 30 layers repeat a few dozen; creating one with symbolic sizes costs ~0.3 ms.
    made: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def move(v: Any) -> Any:
        # a fresh fake tensor of the same sizes and strides: what ``v.to(device)`` gives for a dense
        # value, without its copy (``_to_copy``'s decomposition)
        if not isinstance(v, torch.Tensor) or v.device == device:
            return v
        key = (tuple(map(size_expr, v.shape)), tuple(map(size_expr, v.stride())), v.dtype)
        if key not in made:
            made[key] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return made[key]

    with symbolic_fake_mode(mode):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if val is None:
                continue
            new = torch.utils._pytree.tree_map(move, val)
            if new is not val:
                node.meta = {**node.meta, "val": new}
                n += 1
    return n


@dataclass
class Placement:
    """What ``place_weights`` did (reported in the ``load_weights`` snapshot)."""

    device: str
    tensors: int = 0
    bytes: int = 0  # bytes the graph holds afterwards (each storage once)
    bytes_copied: int = 0  # bytes that had to be copied to reach the device
    bytes_made: int = 0  # bytes a declared conversion made (a rank's weight shards, repacked checkpoints)
    bound_from_source: int = 0  # meta tensors replaced by the eager model's tensors
    bound_by_binding: List[str] = field(default_factory=list)  # made per record_tensor_binding
    bound_constants: List[str] = field(default_factory=list)  # tensors made in forward (record_forward_constant)
    moved: List[str] = field(default_factory=list)  # names copied across devices (first few)
    device_args_retargeted: int = 0
    values_retargeted: int = 0

    def summary(self) -> str:
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        shared = self.bytes - self.bytes_copied - self.bytes_made
        bound = (
            (
                f"; {len(self.bound_by_binding)} tensors ({mib(self.bytes_made)}) made from the quantized "
                "checkpoint or by a declared conversion (a rank's shards)"
            )
            if self.bound_by_binding
            else ""
        )
        if self.bound_constants:
            bound += f"; {len(self.bound_constants)} tensors made in the model's forward (values recorded at export)"
        return (
            f"{self.tensors} tensors, {mib(self.bytes)} on {self.device}: {mib(self.bytes_copied)} copied, "
            f"{mib(shared)} shared with the eager model or checkpoint{bound}; {self.device_args_retargeted} "
            "nodes retargeted from device=meta"
        )

    def details(self) -> Dict[str, Any]:
        return {
            "summary": self.summary(),
            "device": self.device,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "bytes_copied": self.bytes_copied,
            "bytes_made": self.bytes_made,
            "bytes_shared": self.bytes - self.bytes_copied - self.bytes_made,
            "bound_from_source": self.bound_from_source,
            "moved_examples": self.moved[:5],
            "bound_by_binding": len(self.bound_by_binding),
            "binding_examples": self.bound_by_binding[:5],
            "bound_constants": len(self.bound_constants),
            "constant_examples": self.bound_constants[:5],
            "device_args_retargeted": self.device_args_retargeted,
            "values_retargeted": self.values_retargeted,
        }


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor, original: torch.Tensor) -> None:
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name in owner._parameters:
        owner._parameters[name] = (
            value
            if isinstance(value, torch.nn.Parameter)
            else torch.nn.Parameter(value, requires_grad=original.requires_grad)
        )
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def place_weights(gm: fx.GraphModule, source: Optional[Mapping], device: torch.device) -> Placement:
    """Bind every meta tensor of ``gm`` to its real tensor and put every tensor on ``device``.

    A tensor already on ``device`` is bound as it is (storage shared with the eager model: nothing
    is copied); one elsewhere is copied once (tied names share the copy). Raises ``KeyError``
    naming the tensors that have no real counterpart before anything is changed.
    """
    device = torch.device(device)
    attrs = tensor_attributes(gm)
    resolver = WeightResolver(gm, source)
    missing = resolver.missing([n for n, t in attrs.items() if t.is_meta])
    if missing:
        raise KeyError(
            f"{len(missing)} graph tensor(s) have no real weights to load: {missing[:5]}. They are not "
            "parameters or buffers of the eager model and no transform recorded how it derived them "
            "(record_weight_view, record_tensor_binding: a binding to a quantized checkpoint needs the "
            "model loaded from that checkpoint); the transform that created them must run after weight_load."
        )
    out = Placement(device=str(device))
    memo: Dict[int, torch.Tensor] = {}  # id(original graph tensor) -> placed tensor (keeps ties)
    seen_storage: set = set()
    made: set = set()  # storages a binding's conversion allocated (not the source's own tensor)
    source_storages = {
        _storage(v)
        for v in (source.values() if source is not None else ())
        if isinstance(v, torch.Tensor) and not v.is_meta
    }
    for name, t in attrs.items():
        if id(t) not in memo:
            real = resolver(name) if t.is_meta else t
            if t.is_meta and name in resolver.bindings:
                out.bound_by_binding.append(name)
            elif t.is_meta and name in resolver.constants and name not in resolver.source:
                out.bound_constants.append(name)
            else:
                out.bound_from_source += int(t.is_meta)
            placed = real
            if not _on(real, device):
                placed = real.detach().to(device)
                out.bytes_copied += placed.numel() * placed.element_size()
                out.moved.append(name)
            elif t.is_meta and name in resolver.bindings and _storage(placed) not in source_storages:
                made.add(_storage(placed))
            if isinstance(t, torch.nn.Parameter) and not isinstance(placed, torch.nn.Parameter):
                placed = torch.nn.Parameter(placed, requires_grad=False)
            memo[id(t)] = placed
        placed = memo[id(t)]
        _set_attr(gm, name, placed, t)
        key = (placed.device, placed.untyped_storage().data_ptr())
        if key not in seen_storage:
            seen_storage.add(key)
            out.bytes += placed.untyped_storage().nbytes()
            out.bytes_made += placed.untyped_storage().nbytes() if key in made else 0
    out.tensors = len(memo)
    trace = gm.meta.get(TRACE_DEVICE_KEY)
    for old in {"meta", *([trace] if trace else [])}:
        if old != device.type:
            out.device_args_retargeted += retarget_node_devices(gm, old, device)
    out.values_retargeted = retarget_values(gm, device)
    gm.meta[TRACE_DEVICE_KEY + "_loaded_on"] = str(device)
    return out


def _storage(t: torch.Tensor) -> Tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


__all__ = ["Placement", "place_weights", "retarget_node_devices", "retarget_values"]
