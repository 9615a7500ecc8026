"""Frozen graph copies for snapshots: the graph structure is copied, parameters are shared.

Copying a 2,000-node graph costs ~2.5 MB of Python objects; turning it into a GraphModule
(nested attribute modules, generated code) costs as much again plus ~0.4 s. Most snapshots are
only read (tables, diffs, renders read the graph), so the GraphModule is built on first use, and
``materialize()`` gives a fresh, independent module to resume the pipeline from.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch
import torch.fx as fx

from .utils import graph_modules, lazy_graph_module
from .weights import fetch_attr

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
# Attributes every GraphModule has; anything else on an instance was attached by its creator
# (export attaches validate_inputs, _in_spec, _out_spec, range_constraints, ...).
_GM_BASE_ATTRS = frozenset(fx.GraphModule(torch.nn.Module(), fx.Graph()).__dict__) | {"meta"}


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """Node-for-node copy; meta dicts are copied shallowly (fake values are shared, immutable)."""
    new = fx.Graph(owning_module=None, tracer_cls=graph._tracer_cls)
    val_map: Dict[fx.Node, fx.Node] = {}
    out_args, out_node = new.graph_copy(graph, val_map, return_output_node=True)
    new_out = new.output(out_args, type_expr=out_node.type)
    new_out.meta = copy.copy(out_node.meta)
    new._codegen = graph._codegen  # in/out pytree specs; never mutated in place
    return new


class GraphCopy:
    """A snapshot's copy of a module: built lazily, resumable with ``materialize()``."""

    def __init__(self, mod: torch.nn.Module):
        self._module: Optional[torch.nn.Module] = None
        if not isinstance(mod, fx.GraphModule):
            # A wrapper around graph modules (e.g. a compiled runner): copy eagerly, it is rare.
            self._graph = None
            self._module = copy_module(mod)
            return
        self._graph = copy_graph(mod.graph)
        self._class_name = type(mod).__name__
        self._attrs = {
            n.target: fetch_attr(mod, n.target) for n in mod.graph.nodes if n.op in ("get_attr", "call_module")
        }
        buffer_names = {name for name, _ in mod.named_buffers()}
        # fx.GraphModule(dict, graph) re-attaches tensors as plain attributes; remember which were
        # registered buffers so memory accounting (and .buffers()) sees them as before.
        self._buffer_targets = sorted(t for t in self._attrs if t in buffer_names)
        self._meta = dict(getattr(mod, "meta", {}))
        self._extra = {k: v for k, v in mod.__dict__.items() if k not in _GM_BASE_ATTRS}
        self._hooks = {h: dict(getattr(mod, h)) for h in _HOOK_DICTS if hasattr(mod, h)}

    @property
    def graph(self) -> fx.Graph:
        """The frozen graph (read it, never mutate it)."""
        if self._graph is None:
            assert self._module is not None  # copied eagerly in __init__
            return graph_modules(self._module)[0].graph
        return self._graph

    @property
    def module(self) -> torch.nn.Module:
        """A GraphModule over the frozen graph, built once on first access (read-only use)."""
        if self._module is None:
            self._module = self._build(self._graph)
        return self._module

    def materialize(self) -> torch.nn.Module:
        """A fresh module with its own graph copy, to run more transforms on."""
        if self._graph is None:
            assert self._module is not None  # copied eagerly in __init__
            return copy_module(self._module)
        return self._build(copy_graph(self._graph))

    def _build(self, graph: fx.Graph) -> fx.GraphModule:
        gm = lazy_graph_module(self._attrs, graph, class_name=self._class_name)
        for target in self._buffer_targets:
            parent, _, name = target.rpartition(".")
            owner = gm.get_submodule(parent) if parent else gm
            tensor = getattr(owner, name)
            if name not in owner._buffers:
                delattr(owner, name)
                owner.register_buffer(name, tensor)
        gm.meta = dict(self._meta)
        for name, value in self._extra.items():
            gm.__dict__.setdefault(name, value)
        for name, hooks in self._hooks.items():
            getattr(gm, name).update(hooks)
        return gm


def copy_module(mod: torch.nn.Module) -> torch.nn.Module:
    """Copy ``mod`` so later graph rewrites do not touch it; parameters stay shared.

    Handles a bare GraphModule (the common case) and a wrapper holding GraphModules (e.g. after a
    compile backend wraps the graph): the wrapper is shallow-copied and each graph copied.
    """
    if isinstance(mod, fx.GraphModule):
        return GraphCopy(mod).module  # built from its own graph copy: independent of mod
    new = copy.copy(mod)
    new._modules = dict(mod._modules)
    for name, sub in list(new._modules.items()):
        if sub is not None and (isinstance(sub, fx.GraphModule) or graph_modules(sub)):
            new._modules[name] = copy_module(sub)
    return new
