"""An export-cache record (``graph_record.record_of``) built back into a graph module: ``module_of``.

The fake values are rebuilt in a fresh fake mode whose shape environment has the input dims with
export's hints and ranges: one SymInt per expression and one fake tensor per distinct description
(re-propagating the fake values instead costs ~3.5 s for smollm2's 2,600 nodes, more than
exporting). Parameters and buffers come back on ``meta`` with their names, shapes and dtypes; the
graph gets the record's pytree calling convention and the graph module its meta.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...graph.utils import lazy_graph_module
from ...graph.weights import fetch_attr
from ...interface import TransformInfo
from .graph_record import _MISSING, _Fake, _Ref, _resolve_function, _SymInt


def module_of(record: Dict[str, Any]) -> Tuple[fx.GraphModule, TransformInfo]:
    """The graph module and report kept in ``record``, with fresh fake values on meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    symbols = _new_symbols(shape_env, record["symbols"])
    hints = {new: hint for (_, hint, _, _), new in zip(record["symbols"], symbols.values())}

    # One SymInt per expression and one fake tensor per description (~0.8 ms each through the fake
    # mode): the nodes of the 30 layers share them, as the stamped layers of an export do.
    symints: Dict[Any, Any] = {}
    fakes: Dict[_Fake, torch.Tensor] = {}

    def symint(expr: Any) -> Any:
        if isinstance(expr, int):
            return expr
        if expr not in symints:
            new = expr.xreplace(symbols)
            symints[expr] = shape_env.create_symintnode(new, hint=int(new.xreplace(hints)))
        return symints[expr]

    def build(desc: Any) -> Any:
        if isinstance(desc, _Fake):
            if desc not in fakes:
                size = tuple(symint(s) for s in desc.size)
                stride = tuple(symint(s) for s in desc.stride)
                t = torch.empty_strided(size, stride, dtype=desc.dtype, device=desc.device)
                offset = symint(desc.offset)
                fakes[desc] = t if (isinstance(offset, int) and offset == 0) else t.as_strided(size, stride, offset)
            return fakes[desc]
        if isinstance(desc, _SymInt):
            return symint(desc.expr)
        if isinstance(desc, (list, tuple)):
            items = [build(d) for d in desc]
            return items if isinstance(desc, list) else tuple(items)
        if isinstance(desc, dict):
            return {k: build(d) for k, d in desc.items()}
        return desc

    graph = fx.Graph()
    env: Dict[str, fx.Node] = {}

    def decode(value: Any) -> Any:
        if isinstance(value, _Ref):
            return env[value.name]
        if isinstance(value, list):
            return [decode(v) for v in value]
        if isinstance(value, tuple):
            return tuple(decode(v) for v in value)
        if isinstance(value, dict):
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(decode(value.start), decode(value.stop), decode(value.step))
        return value

    with mode:
        for name, op, target, args, kwargs, meta, val, eager in record["nodes"]:
            if op == "output":
                node = graph.output(decode(args[0]))
            else:
                node = graph.create_node(op, _target(target), decode(args), decode(kwargs), name=name)
            if node.name != name:
                raise ValueError(f"export cache: node {name} came back as {node.name}")
            node.meta.update(meta)
            if not _missing(val):
                node.meta["val"] = build(val)
            if not _missing(eager):
                node.meta["eager_input_vals"] = build(eager)
            env[name] = node
    orig_args, in_spec, out_spec = record["codegen"]
    graph._codegen = fx.graph._PyTreeCodeGen(
        fx.graph._PyTreeInfo(orig_args, pytree.treespec_loads(in_spec), pytree.treespec_loads(out_spec))
    )
    root = torch.nn.Module()
    for name, shape, dtype, is_buffer, is_param in record["tensors"]:
        _assign(root, name, torch.empty(shape, dtype=dtype, device="meta"), is_buffer, is_param)
    gm = lazy_graph_module(root, graph, class_name=record["class_name"])
    for name, shape, dtype, is_buffer, is_param in record["tensors"]:  # those the graph does not read too
        if not _has(gm, name):
            _assign(gm, name, torch.empty(shape, dtype=dtype, device="meta"), is_buffer, is_param)
    gm.meta.update(record["gm_meta"])
    for node in graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            node.meta["val"] = mode.from_tensor(fetch_attr(gm, node.target), static_shapes=True)
    return gm, TransformInfo(**record["info"])


def _new_symbols(shape_env: Any, saved: List[Tuple[Any, int, Optional[int], Optional[int]]]) -> Dict[Any, Any]:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    out = {}
    for old, hint, lo, hi in saved:
        new = shape_env.create_symbol(hint, source=ConstantSource(f"wb_export_{old}"), dynamic_dim=DimDynamic.DYNAMIC)
        if lo is not None and hi is not None:
            shape_env.constrain_symbol_range(new, compiler_min=lo, compiler_max=hi)
        out[old] = new
    return out


def _target(encoded: Any) -> Any:
    kind = encoded[0]
    if kind == "str":
        return encoded[1]
    if kind == "op":
        _, namespace, name, overload = encoded
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    fn = _resolve_function(encoded[1], encoded[2])
    if fn is None:
        raise ValueError(f"export cache: {encoded[1]}.{encoded[2]} not found")
    return fn


def _missing(desc: Any) -> bool:
    return isinstance(desc, str) and desc == _MISSING


def _assign(root: torch.nn.Module, name: str, t: torch.Tensor, is_buffer: bool, is_param: bool) -> None:
    owner = root
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if is_param:
        owner.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    elif is_buffer:
        owner.register_buffer(leaf, t)
    else:
        setattr(owner, leaf, t)


def _has(root: torch.nn.Module, name: str) -> bool:
    try:
        fetch_attr(root, name)
        return True
    except AttributeError:
        return False


__all__ = ["module_of"]
