"""Graph-module weights by attribute: reading them, concatenating some into one new parameter, and
dropping the ones no node reads any more with an exact count of the bytes freed.

Shared by the transforms that rewrite weights after ``load_weights`` (``fuse_gemms``,
``fuse_swiglu``, ``linear_weight_layout``) and by those that only read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

LINEAR = torch.ops.aten.linear.default


def linear_bias(node: fx.Node) -> Any:
    """The bias argument of an ``aten.linear`` node (None when it has none)."""
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def param_of(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The tensor a ``get_attr`` node reads, else None (placeholders, computed values)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = fetch_attr(gm, node.target)
    return value if isinstance(value, torch.Tensor) else None


def _owner_and_names(targets: Sequence[str]) -> Tuple[str, List[str]]:
    """Deepest common module path of ``targets`` and the targets relative to it."""
    parts = [t.split(".")[:-1] for t in targets]
    common: List[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common), [".".join(t.split(".")[len(common) :]) for t in targets]


def _fused_attr_name(module: torch.nn.Module, local: Sequence[str]) -> str:
    """``fused_q_proj_k_proj_v_proj_weight`` from ``q_proj.weight, k_proj.weight, ...``."""
    leaf = local[0].rsplit(".", 1)[-1]
    stems = [name[: -len(leaf) - 1] if name.endswith("." + leaf) else name for name in local]
    base = "fused_" + "_".join(s.replace(".", "_") for s in stems) + "_" + leaf
    name, i = base, 1
    while hasattr(module, name):
        name, i = f"{base}_{i}", i + 1
    return name


def fake_value(gm: fx.GraphModule, tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A fake tensor for a new ``get_attr`` in the graph's fake mode (None when there is none)."""
    # The graph's inputs come first and all share its one fake mode: the first fake value found
    # decides (scanning every node's value per call cost ~0.2 s in fuse_gemms on a 30-layer model).
    mode = None
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            mode = detect_fake_mode([v])
            if mode is not None:
                break
    return mode.from_tensor(tensor, static_shapes=True) if mode is not None else None


def concat_weights(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], dim: int = 0, alias_originals: bool = False
) -> Tuple[str, int]:
    """Concatenate the tensors ``nodes`` (``get_attr``) read into ONE new attribute of ``gm``.

    Registered on the deepest module holding all of them, as a Parameter (requires_grad=False)
    when the originals are parameters, else as a buffer. Returns (target, bytes allocated).
    ``alias_originals``: the original tensor objects then read their rows of the new one
    (``alias_rows``), so the weights are held once (see there).
    """
    targets = [n.target for n in nodes]
    tensors = [fetch_attr(gm, t) for t in targets]
    with torch.no_grad():
        fused = torch.cat([t.detach() for t in tensors], dim=dim)
    if alias_originals and dim == 0:
        alias_rows(fused, tensors)
    owner_path, local = _owner_and_names(targets)
    owner = gm.get_submodule(owner_path) if owner_path else gm
    name = _fused_attr_name(owner, local)
    if all(isinstance(t, torch.nn.Parameter) for t in tensors):
        owner.register_parameter(name, torch.nn.Parameter(fused, requires_grad=False))
    else:
        owner.register_buffer(name, fused)
    return (f"{owner_path}.{name}" if owner_path else name), fused.numel() * fused.element_size()


def alias_rows(fused: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Point each of ``tensors`` (contiguous, concatenated in order along dim 0 into ``fused``) at
    its rows of ``fused``'s storage; returns whether it did.

    The values are the same bytes, so every holder of these tensor objects -- the eager reference
    model (whose tensors ``load_weights`` bound, not copied), the snapshots since -- reads what it
    read before, and the originals' own storage is freed once nothing else holds it: the fused
    weights cost no second copy (smollm2 Q4_1: 44 MB of peak RSS). Skipped (False) unless every
    tensor is a contiguous, real (not meta) tensor of ``fused``'s dtype and device, laid out as
    ``torch.cat`` put it."""
    if fused.is_meta or not fused.is_contiguous() or fused.storage_offset() != 0:
        return False
    rows = 0
    for t in tensors:
        if t.is_meta or not t.is_contiguous() or t.dtype != fused.dtype or t.device != fused.device:
            return False
        if t.dim() != fused.dim() or t.shape[1:] != fused.shape[1:]:
            return False
        rows += t.shape[0]
    if rows != fused.shape[0]:
        return False
    storage, offset = fused.untyped_storage(), 0
    with torch.no_grad():
        for t in tensors:
            t.set_(storage, offset, t.shape, t.stride())
            offset += t.numel()
    return True


def storage_bytes(gm: torch.nn.Module) -> Dict[Tuple[torch.device, int], int]:
    """Storage -> bytes over every parameter and buffer name (tied names included)."""
    out = {}
    for _, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if t.device.type != "meta":
            s = t.untyped_storage()
            out[(t.device, s.data_ptr())] = s.nbytes()
    return out


@dataclass
class Released:
    freed_bytes: int = 0
    dropped: List[str] = field(default_factory=list)  # attributes removed from the module
    kept: List[str] = field(default_factory=list)  # still read by a graph node: stays
    tied: List[str] = field(default_factory=list)  # dropped, but another name holds the storage


def _storage_key(t: torch.Tensor) -> Tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def release_weights(gm: fx.GraphModule, targets: Sequence[str]) -> Released:
    """Drop attributes ``targets`` that no graph node reads any more; count the freed bytes.

    A target still read by a ``get_attr`` node stays. A dropped attribute whose storage another
    attribute still holds (tied weights) frees nothing; only storages that leave the module count.
    """
    if not targets:
        return Released()
    wanted = set(targets)
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in wanted]:
        if not node.users:
            gm.graph.erase_node(node)
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    before = storage_bytes(gm)
    out = Released()
    keys = {}
    for target in dict.fromkeys(targets):
        if target in read:
            out.kept.append(target)
            continue
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if hasattr(owner, name):
            keys[target] = _storage_key(getattr(owner, name))
            delattr(owner, name)
            out.dropped.append(target)
    after = storage_bytes(gm)
    out.freed_bytes = sum(nbytes for key, nbytes in before.items() if key not in after)
    out.tied = [t for t in out.dropped if keys[t] in after]
    return out


__all__ = [
    "LINEAR",
    "linear_bias",
    "fetch_attr",
    "param_of",
    "fake_value",
    "concat_weights",
    "alias_rows",
    "release_weights",
    "storage_bytes",
    "Released",
]
