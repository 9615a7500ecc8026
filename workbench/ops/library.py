"""``define_op``: register a ``workbench::`` op whose Python body runs with little dispatch cost.

``torch.library.custom_op`` wraps its function in Python-side dispatch (argument handling,
autograd and inplace/view kernels): ``bench/op_dispatch.py`` (RMSNorm on a [1, 1, 576] input, one
thread, this project's CPU machine) measured 28.0 us per call through ``custom_op``, 19.8 us through
a ``Library`` registration, 15.4 us calling the function directly (34.6 / 18.6 / 15.7 in an earlier
ad-hoc run). A SmolLM2 decode step calls the
canonical RMSNorm, RoPE and SiLU*mul ops 121 times and the cached attention 30 times, so the ops on
that path register here instead: the schema is declared once, the body is the
``CompositeExplicitAutograd`` kernel (the C++ fallbacks do autograd and version counters), and
the fake implementation serves export, shape propagation and ``torch.compile``.

The returned value is the op packet (``torch.ops.workbench.<name>``): calling it dispatches, so
graphs traced through it keep the op as one node.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .capture import host_sync_tags

# One fragment for every op defined here; kept alive for the process (dropping it unregisters them).
_LIB = torch.library.Library("workbench", "FRAGMENT")


# op name ("torch_nvfp4_linear") -> the relative rounding step of the activation quantization the
# op does inside (its inputs rounded to a coarser grid than the model's dtype before the product).
# Such an op's result moves by up to that step when its input moves by a float32 rounding, and 30
# layers compound it: ``workbench.runtime.runner.cache_check_tolerance`` widens by it.
_ACTIVATION_ROUNDING: Dict[str, float] = {}


def _register(name: str, host_sync: Optional[str], activation_rounding: Optional[float]) -> Tuple[torch.Tag, ...]:
    if activation_rounding is not None:
        _ACTIVATION_ROUNDING[name] = float(activation_rounding)
    return host_sync_tags(f"workbench::{name}", host_sync) if host_sync else ()


def activation_rounding(name: str) -> Optional[float]:
    """The relative rounding step of the activation quantization inside ``workbench::<name>``
    (``None``: the op computes in its inputs' dtype)."""
    return _ACTIVATION_ROUNDING.get(name)


def define_op(
    schema: str,
    impl: Callable,
    fake: Callable,
    host_sync: Optional[str] = None,
    activation_rounding: Optional[float] = None,
):
    """Define ``workbench::<schema>``, run by ``impl``, with fake (meta) implementation ``fake``.

    ``schema``: the op's signature, e.g. ``"torch_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor"``
    (mutated inputs marked ``Tensor(a!)``). ``host_sync``: why the op reads device values on the
    host, if it does (a CUDA graph cannot capture it: ``workbench.ops.capture``).
    ``activation_rounding``: the relative step of the grid the op rounds its activations to, if it
    quantizes them (int8 per block: 2**-7; FP8 E4M3: 2**-3; FP4 E2M1: 2**-1). Returns
    ``torch.ops.workbench.<name>``.
    """
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_register(name, host_sync, activation_rounding))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


def declare_op(
    schema: str, fake: Callable, host_sync: Optional[str] = None, activation_rounding: Optional[float] = None
):
    """Declare ``workbench::<schema>`` with only its fake implementation: the kernels come from
    compiled code (``workbench.ops.cpu_kernels``) registered for their dispatch keys when it loads.
    Declared at import so graphs that name the op trace and propagate shapes on any machine.
    ``host_sync``, ``activation_rounding``: as for ``define_op``."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_register(name, host_sync, activation_rounding))
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


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


__all__ = ["MISSING", "define_op", "declare_op", "activation_rounding", "schema_arguments"]
