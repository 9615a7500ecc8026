"""Every Triton kernel's source can be hashed by the Triton that runs it.

Triton computes a kernel's cache key from its source and the jitted functions it calls before the
first launch; Triton 3.6 (the GPU image's) fails there on some constructs that later versions and
the interpreter accept (a nested tuple unpacked in one assignment raised "unhashable type: 'list'"
on an H100 while every CPU test passed). So the key of every kernel is computed here, with the
installed Triton: no GPU needed, and on an older Triton the same check fails where it would.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import types

import pytest

import workbench
from workbench.ops.triton_support import HAS_TRITON


def _kernel_modules():
    root = os.path.dirname(workbench.__file__)
    for info in pkgutil.walk_packages([root], prefix="workbench."):
        path = os.path.join(root, *info.name.split(".")[1:]) + ("/__init__.py" if info.ispkg else ".py")
        if os.path.exists(path) and "triton.jit" in open(path, encoding="utf-8").read():
            yield info.name


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter hashes no kernel source")
def test_every_triton_kernel_source_hashes():
    from triton.runtime.jit import JITFunction

    modules = list(_kernel_modules())
    assert len(modules) >= 10, modules  # the attention, norm/rope, MoE, SSM, conv and delta-rule kernels
    kernels, failed = 0, {}
    for name in modules:
        for attr, obj in _jitted(vars(importlib.import_module(name))):
            kernels += 1
            try:
                obj.cache_key
            except Exception as e:  # noqa: BLE001 - every kernel is reported, not just the first
                failed[f"{name}.{attr}"] = f"{type(e).__name__}: {e}"
    assert kernels >= 20 and not failed, (kernels, failed)


def _jitted(namespace):
    """The module's kernels: module-level ones, and those its cached builders return (modules that
    must import without triton define their kernels in a ``functools.lru_cache`` function)."""
    from triton.runtime.jit import JITFunction

    def found(name, value, depth=0):
        if isinstance(value, JITFunction):
            yield name, value
        elif depth < 2 and isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                yield from found(f"{name}[{i}]", v, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for k, v in value.items():
                yield from found(f"{name}[{k!r}]", v, depth + 1)
        elif depth < 2 and isinstance(value, types.SimpleNamespace):
            yield from found(name, vars(value), depth + 1)

    for attr, obj in list(namespace.items()):
        if isinstance(obj, functools._lru_cache_wrapper) and not inspect.signature(obj).parameters:
            yield from found(f"{attr}()", obj())
        elif isinstance(obj, JITFunction):
            yield attr, obj
