"""The one way to define a ``workbench::`` op: ``define_op`` (or ``@workbench_op``, its decorator
form with the schema inferred from type hints; ``declare_op`` for ops whose kernels are compiled
code), each with the op's ``OpTraits`` -- what the passes need to know about it -- declared there.

Why not ``torch.library.custom_op``: it wraps its function in Python-side dispatch (argument
handling, autograd and inplace/view kernels): ``bench/op_dispatch.py`` (RMSNorm on a [1, 1, 576]
input, one thread, this project's CPU machine) measured 28.0 us per call through ``custom_op``,
19.8 us through a ``Library`` registration, 15.4 us calling the function directly. A SmolLM2 decode
step calls the canonical RMSNorm, RoPE and SiLU*mul ops 121 times and the cached attention 30
times. Here the schema is declared once, the body is the ``CompositeExplicitAutograd`` kernel (the
C++ fallbacks do autograd and version counters), and the fake implementation serves export, shape
propagation and ``torch.compile``.

The returned value is the op packet (``torch.ops.workbench.<name>``): calling it dispatches, so
graphs traced through it keep the op as one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx

from .capture import host_sync_tags

# One fragment for every op defined here; kept alive for the process (dropping it unregisters them).
_LIB = torch.library.Library("workbench", "FRAGMENT")


#: The cost model's categories (``workbench.analysis.cost``); every op declares one.
CATEGORIES = ("attention", "norm", "matmul", "elementwise", "moe", "quant", "collective", "other")
#: The normalizations an op may be (over the last dim; per head when its input has a head dim).
NORM_KINDS = ("rms", "l2")


@dataclass(frozen=True)
class OpTraits:
    """What the passes need to know about an op, declared where the op is defined (``define_op``)
    instead of kept in lists at each pass:

    - ``category``: the cost model's category (``CATEGORIES``), also its profiler row.
    - ``norm``: the normalization it is (``NORM_KINDS``), or None: sharding follows a per-head norm
      between a projection and attention, multi-stream keeps norms on the main stream.
    - ``reference``: a plain function with the op's semantics, or None: the compile stage inlines
      it into the copy of the graph it hands Inductor (``ops/inline.py``).
    - ``host_sync``: why it reads device values on the host, or None: a CUDA graph captures it
      (``ops/capture.py`` reads the op's ``cudagraph_unsafe`` tag, set from this).
    - ``activation_rounding``: the relative step of the grid it rounds its activations to, if it
      quantizes them (int8 per block: 2**-7; FP8 E4M3: 2**-3; FP4 E2M1: 2**-1): a 30-layer model
      compounds it, so ``runtime.cache_check`` widens its tolerance by it.
    """

    category: str
    norm: Optional[str] = None
    reference: Optional[Callable] = None
    host_sync: Optional[str] = None
    activation_rounding: Optional[float] = None

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"op category {self.category!r} is not one of {CATEGORIES}")
        if self.norm is not None and self.norm not in NORM_KINDS:
            raise ValueError(f"norm kind {self.norm!r} is not one of {NORM_KINDS}")

    @property
    def capture_safe(self) -> bool:
        return self.host_sync is None


_TRAITS: Dict[str, OpTraits] = {}  # op name ("torch_rmsnorm") -> its traits, one entry per defined op


def _register(name: str, traits: OpTraits) -> Tuple[torch.Tag, ...]:
    if name in _TRAITS:
        raise ValueError(f"workbench::{name} is defined twice")
    _TRAITS[name] = traits
    return host_sync_tags(f"workbench::{name}", traits.host_sync) if traits.host_sync else ()


def op_traits(op: Any) -> Optional[OpTraits]:
    """The traits of a ``workbench::`` op: its name, packet, overload or an FX node calling it;
    None for anything else (aten ops, Python functions)."""
    if isinstance(op, torch.fx.Node):
        op = op.target if op.op == "call_function" else None
    schema = getattr(op, "_schema", None)
    if schema is not None:
        ns, _, op = schema.name.partition("::")
        if ns != "workbench":
            return None
    elif isinstance(op, torch._ops.OpOverloadPacket):
        op = op._qualified_op_name.partition("::")[2]
    return _TRAITS.get(op) if isinstance(op, str) else None


def ops_with(predicate: Callable[[OpTraits], bool]) -> Dict[str, OpTraits]:
    """Every defined op whose traits satisfy ``predicate``, by name (importing ``workbench.ops``
    defines them all)."""
    return {name: t for name, t in _TRAITS.items() if predicate(t)}


def activation_rounding(name: str) -> Optional[float]:
    """The relative rounding step of the activation quantization inside ``workbench::<name>``
    (``None``: the op computes in its inputs' dtype)."""
    traits = _TRAITS.get(name)
    return None if traits is None else traits.activation_rounding


def define_op(schema: str, impl: Callable, fake: Optional[Callable], *, category: str, **traits: Any):
    """Define ``workbench::<schema>``, run by ``impl``, with fake (meta) implementation ``fake``
    (None: registered next, by ``register_fake``) and its ``OpTraits`` (``category``, and by
    keyword ``norm``, ``reference``, ``host_sync``, ``activation_rounding``).

    ``schema``: the op's signature, e.g. ``"torch_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor"``
    (mutated inputs marked ``Tensor(a!)``). Returns ``torch.ops.workbench.<name>``.
    """
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_register(name, OpTraits(category, **traits)))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    if fake is not None:
        torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


def declare_op(schema: str, fake: Callable, *, category: str, **traits: Any):
    """``define_op`` without a Python body: the kernels come from compiled code
    (``workbench.ops.cpu_kernels``) registered for their dispatch keys when it loads. Declared at
    import so graphs that name the op trace and propagate shapes on any machine."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_register(name, OpTraits(category, **traits)))
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


class DefinedOp:
    """What ``@workbench_op`` leaves under the function's name: calling it dispatches to the op
    (``torch.ops.workbench.<name>``); ``register_fake`` decorates its fake implementation."""

    def __init__(self, packet):
        self.packet = packet
        self.__name__ = packet.__name__
        self.default = packet.default

    def __call__(self, *args, **kwargs):
        return self.packet(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"workbench::{self.__name__}", fake, lib=_LIB)
        return fake


def workbench_op(name: str, *, category: str, mutates_args: Tuple[str, ...] = (), **traits: Any):
    """``define_op`` as a decorator, the schema inferred from the function's type hints (as
    ``torch.library.custom_op`` does, without its per-call Python dispatch layer)::

        @workbench_op("torch_l2norm", category="norm", norm="l2")
        def torch_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor: ...

        @torch_l2norm.register_fake
        def _(x, eps=1e-6): ...
    """

    def wrap(fn: Callable) -> DefinedOp:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        return DefinedOp(define_op(name + schema, fn, None, category=category, **traits))

    return wrap


def check_named_args(op: Any, args_type: Any) -> None:
    """``args_type`` (a ``NamedTuple`` of an op's arguments, for launchers that read them by name)
    must name ``op``'s schema arguments in order, with the schema's defaults: a ``TypeError`` at
    definition time rather than a kernel reading the wrong argument."""
    arguments = op.default._schema.arguments
    names = tuple(a.name for a in arguments)
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    if names != args_type._fields or defaults != args_type._field_defaults:
        raise TypeError(
            f"{args_type.__name__} {args_type._fields} (defaults {args_type._field_defaults}) does not match "
            f"the schema of {op.default._schema.name}: {names} (defaults {defaults})"
        )


MISSING = object()  # a required argument the call did not give


def schema_arguments(node: Any) -> List[Tuple[Any, Any]]:
    """``(schema argument, value)`` for every argument of the operator call ``node`` (an FX node
    whose target is an ``OpOverload``): given positionally, by keyword or left to its default, in
    the schema's order; ``MISSING`` for a required argument the call did not give. What a pattern
    comparing calls and a boxed dispatcher call (which takes every argument) both need."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            value = MISSING
        out.append((arg, value))
    return out


__all__ = [
    "CATEGORIES",
    "NORM_KINDS",
    "MISSING",
    "OpTraits",
    "DefinedOp",
    "define_op",
    "check_named_args",
    "declare_op",
    "workbench_op",
    "op_traits",
    "ops_with",
    "activation_rounding",
    "schema_arguments",
]
