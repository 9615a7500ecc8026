"""An export-cache record (``graph_record.record_of``) as JSON and back: a format that cannot carry code.

A pickle names any importable callable and calls it while loading, so an entry someone else wrote
could run code in the next ``workbench run``. Reading this format calls nothing a file names except
from fixed tables: torch dtypes, devices, layouts and memory formats by name; sympy's arithmetic,
comparison and logic classes and torch's symbolic-size functions (``torch.utils._sympy.functions``)
by module and name, built from already-decoded sympy values only (never from text, which sympy would
parse); and, for classes or functions held in node meta (e.g. ``source_fn_stack``), a lookup in
modules this process has already imported -- no import, no call. A tampered entry can at worst fail
to decode (the model is exported again) or decode to another graph, which the cache's directory
check (a directory only its owner can write) and the export key guard against as before.

Layout: ``{"format", "shared": [...], "record": ...}``. Values are JSON scalars, lists (a Python
tuple: node entries and arguments are mostly tuples) or one-key objects tagging everything else:
``l`` list, ``D`` dict (as pairs), ``V``/``Z`` set/frozenset, ``R`` a node reference, ``K`` a
fake-tensor description, ``Y`` a SymInt, ``S`` a sympy expression, ``L`` a slice, ``E`` Ellipsis,
``G`` a class or function by name, ``#`` an entry of ``shared``, and ``F`` (a non-finite float),
``dt``/``dv``/``ly``/``mf`` (a torch dtype/device/layout/memory format) from ``graph/json_values``.
Fake-tensor descriptions, sympy expressions and long strings (stack traces, module paths) are
written once in ``shared`` and referenced by index: the 30 stamped layers repeat a few hundred of
them (as pickle's memo did); smollm2's entry is 1.15 MB.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from typing import Any, Dict, List, cast

import sympy
import torch.utils._sympy.functions as torch_sympy

from ...graph.json_values import TAGS as LEAF_TAGS
from ...graph.json_values import decode_leaf, encode_leaf
from .graph_record import Uncacheable, _Fake, _Ref, _SymInt

FORMAT = 2

_SYMPY_NAMES = (
    "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor", "ceiling", "sign", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "And", "Or", "Not", "Piecewise",
)  # fmt: skip
_ABSTRACT = {"Expr", "Application", "LatticeOp", "MinMaxBase"}


def _classes() -> Dict[str, type]:
    """``module.qualname`` -> class for every sympy class a size expression may be built from."""
    found = [getattr(sympy, n) for n in _SYMPY_NAMES] + [sympy.functions.elementary.piecewise.ExprCondPair]
    found += [
        c
        for n, c in vars(torch_sympy).items()
        if isinstance(c, type) and issubclass(c, sympy.Basic) and n not in _ABSTRACT
    ]
    return {f"{c.__module__}.{c.__qualname__}": c for c in found if isinstance(c, type)}


_CLASSES = _classes()
_CONSTANTS = {
    "oo": sympy.oo,
    "-oo": -sympy.oo,
    "zoo": sympy.zoo,
    "nan": sympy.nan,
    "true": sympy.true,
    "false": sympy.false,
}
_CONSTANT_NAMES = {v: k for k, v in _CONSTANTS.items()}
# the assumption names a Symbol takes (``sympy.core`` exports a function of the module's name)
_ASSUMPTIONS = set(importlib.import_module("sympy.core.assumptions")._assume_defined)
_SHARED_STR = 24  # strings longer than this are written once, in ``shared``


# ------------------------------------------------------------------------------------- writing


def dumps(record: Dict[str, Any]) -> bytes:
    """``record`` as JSON bytes; raises ``Uncacheable`` naming a value the format has no spelling for."""
    shared: List[Any] = []
    index: Dict[Any, int] = {}

    def ref(obj: Any, encode_body: Any) -> Dict[str, int]:
        if obj not in index:
            body = encode_body()  # what it refers to is written first
            index[obj] = len(shared)
            shared.append(body)
        return {"#": index[obj]}

    def sym(e: Any) -> Any:
        if isinstance(e, sympy.Integer):
            return {"i": int(e)}
        if isinstance(e, sympy.Rational):
            return {"q": [int(e.p), int(e.q)]}
        if isinstance(e, sympy.Symbol):
            return {"s": e.name, "a": {k: bool(v) for k, v in e.assumptions0.items() if v is not None}}
        if e in _CONSTANT_NAMES:
            return {"c": _CONSTANT_NAMES[e]}
        name = f"{type(e).__module__}.{type(e).__qualname__}"
        if _CLASSES.get(name) is not type(e):
            raise Uncacheable(f"a size expression uses {name}, which the cache format does not hold")
        return {"o": name, "x": [enc(a) for a in cast(sympy.Basic, e).args]}

    def enc(x: Any) -> Any:
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float) and math.isfinite(x):
            return x
        if isinstance(x, str):  # str subclasses too (torch's TorchVersion)
            text = str(x)
            # long strings once (stack traces, module paths: every node of a layer repeats them)
            return ref(("str", text), lambda: {"s": text}) if len(text) > _SHARED_STR else text
        if type(x) is tuple:  # the common case (node tuples, args): a plain JSON list
            return [enc(v) for v in x]
        if isinstance(x, list):
            return {"l": [enc(v) for v in x]}
        if isinstance(x, dict):
            return {"D": [[enc(k), enc(v)] for k, v in x.items()]}
        if isinstance(x, (set, frozenset)):  # in a stable order: equal sets, equal bytes
            return {"Z" if isinstance(x, frozenset) else "V": [enc(v) for v in sorted(x, key=repr)]}
        if isinstance(x, _Ref):
            return {"R": x.name}
        if isinstance(x, _Fake):
            return ref(x, lambda: {"K": [enc(x.size), enc(x.stride), enc(x.offset), enc(x.dtype), x.device]})
        if isinstance(x, _SymInt):
            return {"Y": enc(x.expr)}
        if isinstance(x, sympy.Basic):
            return ref(x, lambda: {"S": sym(x)})
        if isinstance(x, slice):
            return {"L": [enc(x.start), enc(x.stop), enc(x.step)]}
        if x is Ellipsis:
            return {"E": 0}
        encoded = encode_leaf(x)
        if encoded is not None:
            return encoded
        if isinstance(x, type) or callable(x):
            module, name = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
            if module and name and "<" not in name and _named(module, name) is x:
                return {"G": [module, name]}
        raise Uncacheable(f"the record holds a value of type {type(x).__name__}, which the cache format does not hold")

    body = enc(record)
    return json.dumps({"format": FORMAT, "shared": shared, "record": body}, separators=(",", ":")).encode()


def _named(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` in an already-imported module (None otherwise): nothing is imported."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


# ------------------------------------------------------------------------------------- reading


def loads(data: bytes) -> Dict[str, Any]:
    """The record in ``data``; raises ``ValueError`` (or ``KeyError``/``TypeError``) for anything that
    is not a well-formed entry of this format."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or set(doc) != {"format", "shared", "record"} or doc["format"] != FORMAT:
        raise ValueError("not an export-cache record of this format")
    shared: List[Any] = []

    def sym(d: Dict[str, Any]) -> Any:
        if "i" in d:
            return sympy.Integer(_int(d["i"]))
        if "q" in d:
            p, q = d["q"]
            return sympy.Rational(_int(p), _int(q))
        if "s" in d:
            assumptions = d["a"]
            if not isinstance(d["s"], str) or not isinstance(assumptions, dict):
                raise ValueError("a malformed symbol")
            if not set(assumptions) <= _ASSUMPTIONS or not all(isinstance(v, bool) for v in assumptions.values()):
                raise ValueError("a symbol with unknown assumptions")
            return sympy.Symbol(d["s"], **assumptions)
        if "c" in d:
            return _CONSTANTS[d["c"]]
        cls = _CLASSES[d["o"]]
        args = [dec(a) for a in d["x"]]
        if not all(isinstance(a, sympy.Basic) for a in args):
            raise ValueError(f"{d['o']} built from something other than sympy values")
        return cls(*args)

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return tuple([dec(v) for v in x])
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError("a malformed value")
        ((tag, v),) = x.items()
        if tag == "#":
            return shared[_int(v)]
        if tag == "l":
            return [dec(a) for a in v]
        if tag == "D":
            return {dec(k): dec(val) for k, val in v}
        if tag in ("V", "Z"):
            items = [dec(a) for a in v]
            return frozenset(items) if tag == "Z" else set(items)
        if tag == "R":
            return _Ref(_str(v))
        if tag == "Y":
            return _SymInt(dec(v))
        if tag == "L":
            return slice(*(dec(a) for a in v))
        if tag == "E":
            return Ellipsis
        if tag in LEAF_TAGS:
            return decode_leaf(tag, v)
        if tag == "G":
            obj = _named(_str(v[0]), _str(v[1]))
            if obj is None:
                raise ValueError(f"{v[0]}.{v[1]} is not loaded")
            return obj
        raise ValueError(f"unknown tag {tag!r}")

    for entry in doc["shared"]:
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ValueError("a malformed shared entry")
        ((tag, v),) = entry.items()
        if tag == "K":
            size, stride, offset, dtype, device = (dec(a) for a in v)
            shared.append(_Fake(tuple(size), tuple(stride), offset, dtype, _str(device)))
        elif tag == "S":
            shared.append(sym(v))
        elif tag == "s":
            shared.append(_str(v))
        else:
            raise ValueError(f"unknown shared tag {tag!r}")
    return dec(doc["record"])


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError("an integer expected")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("a string expected")
    return v
