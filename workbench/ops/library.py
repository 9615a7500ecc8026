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

from typing import Callable, Optional, Tuple

import torch

from .capture import host_sync_tags

# One fragment for every op defined here; kept alive for the process (dropping it unregisters them).
_LIB = torch.library.Library("workbench", "FRAGMENT")


def _tags(name: str, host_sync: Optional[str]) -> Tuple[torch.Tag, ...]:
    return host_sync_tags(f"workbench::{name}", host_sync) if host_sync else ()


def define_op(schema: str, impl: Callable, fake: Callable, host_sync: Optional[str] = None):
    """Define ``workbench::<schema>``, run by ``impl``, with fake (meta) implementation ``fake``.

    ``schema``: the op's signature, e.g. ``"torch_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor"``
    (mutated inputs marked ``Tensor(a!)``). ``host_sync``: why the op reads device values on the
    host, if it does (a CUDA graph cannot capture it: ``workbench.ops.capture``). Returns
    ``torch.ops.workbench.<name>``.
    """
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_tags(name, host_sync))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


def declare_op(schema: str, fake: Callable, host_sync: Optional[str] = None):
    """Declare ``workbench::<schema>`` with only its fake implementation: the kernels come from
    compiled code (``workbench.ops.cpu_kernels``) registered for their dispatch keys when it loads.
    Declared at import so graphs that name the op trace and propagate shapes on any machine.
    ``host_sync``: as for ``define_op``."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema, tags=_tags(name, host_sync))
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIB)
    return getattr(torch.ops.workbench, name)


__all__ = ["define_op", "declare_op"]
