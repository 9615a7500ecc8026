"""The exported graph as plain data: what ``export_cache.py`` keeps on disk.

A record holds every node (name, op, target -- an operator by its qualified name, a Python
function by module and name --, arguments, and the meta a reader uses: ``nn_module_stack``,
``stack_trace``, ``torch_fn``, ``source_fn_stack``, ``custom``, ``wb_created_by``), every fake value
(``meta['val']``, ``eager_input_vals``) as sizes, strides, storage offset, dtype and device with
symbolic sizes as sympy expressions over the input dims, the parameters and buffers (name, shape,
dtype: rebuilt on ``meta``), the graph module's meta, the pytree calling convention and the
transform's report. ``record_of`` makes one; ``graph_from_record.module_of`` builds the graph back;
``describe`` is what must be the same in both.

Not kept: export's input guards (``_guards_fn`` and its pre-hook, Python code torch generates per
export), ``from_node`` provenance, and facts export's shape environment learnt beyond the input
dims' ranges. Anything else the format cannot hold (a higher-order op, a module call, an unbacked
size, an argument of another type) raises ``Uncacheable`` naming it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from ...graph.utils import placeholder_values
from ...interface import TransformInfo

FORMAT = 1  # bump when the record's layout changes: older entries are then not read
# node meta a reader uses (viz, matchers' inherited meta); the rest is rebuilt (val, tensor_meta,
# eager_input_vals) or not kept (from_node)
KEPT_META = ("nn_module_stack", "stack_trace", "torch_fn", "source_fn_stack", "custom", "wb_created_by")
GUARDS_MODULE = "_guards_fn"
# Python functions a graph may call, by module: operator arithmetic on sizes, torch's sym_* helpers
_FUNCTION_MODULES = ("_operator", "operator", "math", "builtins", "torch", "torch.functional")
_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """The exported graph holds something the cache format cannot keep (the message says what)."""


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node (by name)."""

    name: str


@dataclass(frozen=True)
class _Fake:
    """A fake tensor: sizes/strides/offset are ints or sympy expressions over the input dims."""

    size: Tuple[Any, ...]
    stride: Tuple[Any, ...]
    offset: Any
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class _SymInt:
    expr: Any


# ------------------------------------------------------------------------------------ to a record


def record_of(gm: fx.GraphModule, info: TransformInfo) -> Dict[str, Any]:
    """The cache record of ``export_to_gm``'s result; raises ``Uncacheable``."""
    inputs = _input_symbols(gm)
    allowed = set(inputs)
    # Equal descriptions are kept as one object, so the record writes (and reads) each once: the 30
    # stamped layers repeat the same few hundred shapes.
    interned: Dict[Any, Any] = {}
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == GUARDS_MODULE:
            continue  # export's generated input guards: not kept (module docstring)
        if node.op == "call_module":
            raise Uncacheable(f"node {node.name} calls a module ({node.target})")
        meta = {k: node.meta[k] for k in KEPT_META if k in node.meta}  # record_json says what it cannot hold
        nodes.append(
            (
                node.name,
                node.op,
                _target_of(node),
                _encode(node.args, node.name),
                _encode(node.kwargs, node.name),
                meta,
                _describe_value(node.meta.get("val"), allowed, node.name, interned) if "val" in node.meta else _MISSING,
                _describe_value(node.meta["eager_input_vals"], allowed, node.name, interned)
                if "eager_input_vals" in node.meta
                else _MISSING,
            )
        )
    codegen = gm.graph._codegen
    info_ = getattr(codegen, "pytree_info", None)
    if info_ is None:
        raise Uncacheable("the graph has no pytree calling convention")
    tensors = []
    for is_buffer, items in ((False, gm.named_parameters()), (True, gm.named_buffers())):
        for name, t in items:
            if not t.is_meta:
                raise Uncacheable("the graph holds tensors with values (traced off meta)")
            tensors.append((name, tuple(t.shape), t.dtype, is_buffer, isinstance(t, torch.nn.Parameter)))
    gm_meta = dict(gm.meta)
    shape_env = _shape_env(gm)
    symbols = [
        (sym, int(_hints(shape_env)[sym]), _bound(shape_env, sym, "lower"), _bound(shape_env, sym, "upper"))
        for sym in inputs
    ]
    return {
        "format": FORMAT,
        "nodes": nodes,
        "codegen": (list(info_.orig_args), pytree.treespec_dumps(info_.in_spec), pytree.treespec_dumps(info_.out_spec)),
        "tensors": tensors,
        "gm_meta": gm_meta,
        "symbols": symbols,
        "class_name": type(gm).__name__,
        "info": info.model_dump(),
    }


_MISSING = "<no val>"


def _input_symbols(gm: fx.GraphModule) -> List[sympy.Symbol]:
    """The free symbols of the placeholders' sizes, in order of first appearance."""
    out: List[sympy.Symbol] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Uncacheable(f"input {node.name} has no fake tensor")
        for s in val.shape:
            if isinstance(s, torch.SymInt):
                expr = s.node.expr
                if not isinstance(expr, sympy.Symbol):
                    raise Uncacheable(f"input {node.name} has a size that is not a plain symbol ({expr})")
                if expr not in out:
                    out.append(expr)
    return out


def _shape_env(gm: fx.GraphModule) -> Any:
    mode = detect_fake_mode([v for v in placeholder_values(gm) if isinstance(v, torch.Tensor)])
    if mode is None or mode.shape_env is None:
        raise Uncacheable("the graph's inputs carry no shape environment")
    return mode.shape_env


def _hints(shape_env: Any) -> Dict[Any, Any]:
    # torch 2.13 renamed var_to_val (kept, deprecated) to backed_var_to_val
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


def _bound(shape_env: Any, sym: sympy.Symbol, which: str) -> Optional[int]:
    vr = shape_env.var_to_range.get(sym)
    value = getattr(vr, which, None) if vr is not None else None
    try:
        return int(value) if value is not None else None
    except TypeError:  # +-oo
        return None


def _target_of(node: fx.Node) -> Any:
    target = node.target
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._schema.name.split("::", 1)[1], target._overloadname)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module in _FUNCTION_MODULES and name and "." not in name and _resolve_function(module, name) is target:
        return ("fn", module, name)
    raise Uncacheable(f"node {node.name} calls {target!r}, which the cache cannot name")


def _resolve_function(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, fx.Node):
        return _Ref(value.name)
    if isinstance(value, (list, tuple)):
        items = [_encode(v, where) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _encode(v, where) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_encode(value.start, where), _encode(value.stop, where), _encode(value.step, where))
    if isinstance(value, _LEAVES) or value is Ellipsis:
        return value
    raise Uncacheable(f"node {where} has an argument of type {type(value).__name__}")


def _describe_value(val: Any, allowed: set, where: str, interned: Dict[Any, Any]) -> Any:
    if isinstance(val, torch.Tensor):
        fake = _Fake(
            tuple(_describe_int(s, allowed, where, interned) for s in val.shape),
            tuple(_describe_int(s, allowed, where, interned) for s in val.stride()),
            _describe_int(val.storage_offset(), allowed, where, interned),
            val.dtype,
            str(val.device),
        )
        return interned.setdefault(fake, fake)
    if isinstance(val, torch.SymInt):
        return _SymInt(_describe_int(val, allowed, where, interned))
    if isinstance(val, (list, tuple)):
        items = [_describe_value(v, allowed, where, interned) for v in val]
        return items if isinstance(val, list) else tuple(items)
    if isinstance(val, dict):
        return {k: _describe_value(v, allowed, where, interned) for k, v in val.items()}
    if isinstance(val, _LEAVES):
        return val
    raise Uncacheable(f"node {where}'s value is a {type(val).__name__}")


def _describe_int(s: Any, allowed: set, where: str, interned: Dict[Any, Any]) -> Any:
    if not isinstance(s, torch.SymInt):
        return int(s)
    expr = s.node.expr
    if expr.is_number:
        return int(expr)
    if not expr.free_symbols <= allowed:
        raise Uncacheable(f"node {where} has a size over symbols other than the input dims ({expr})")
    return interned.setdefault(expr, expr)


# ----------------------------------------------------------------------------------- the check


def describe(gm: fx.GraphModule) -> List[Any]:
    """What must be the same in the exported graph and the one built back from its record: nodes
    (export's guards left out), kept meta, fake values with symbols renamed in order of their first
    appearance in the inputs, and every tensor's name, shape, dtype and kind."""
    names: Dict[Any, str] = {}
    for sym in _input_symbols(gm):
        names.setdefault(sym, f"d{len(names)}")
    rename = {sym: sympy.Symbol(n, integer=True, positive=True) for sym, n in names.items()}

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (
                "T",
                [_int(s) for s in v.shape],
                [_int(s) for s in v.stride()],
                _int(v.storage_offset()),
                str(v.dtype),
                str(v.device),
            )
        if isinstance(v, torch.SymInt):
            return ("S", _int(v))
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return repr(v)

    def _int(s: Any) -> str:
        return str(s.node.expr.xreplace(rename)) if isinstance(s, torch.SymInt) else str(int(s))

    out: List[Any] = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == GUARDS_MODULE:
            continue
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        out.append(
            (
                node.name,
                node.op,
                str(node.target),
                repr(args),
                repr({k: node.meta[k] for k in KEPT_META if k in node.meta}),
                value(node.meta.get("val")),
                value(node.meta.get("eager_input_vals")),
            )
        )
    buffers = {name for name, _ in gm.named_buffers()}
    out.append(
        sorted(
            (n, tuple(t.shape), str(t.dtype), n in buffers) for n, t in [*gm.named_parameters(), *gm.named_buffers()]
        )
    )
    out.append(repr(gm.graph._codegen.pytree_info))
    return out


__all__ = ["FORMAT", "GUARDS_MODULE", "KEPT_META", "Uncacheable", "describe", "record_of"]
