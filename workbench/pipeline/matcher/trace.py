"""Tracing for patterns and tests: the same tracer (non-strict ``torch.export``) as the pipeline,
leaving graphs as ``export_to_gm`` and the post-export cleanups leave the model graph."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from ..graph.utils import remove_input_checks, remove_noop_slices, remove_tensor_metadata_asserts


class _FnModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any], kwargs: Mapping[str, Any]):
        super().__init__()
        self.fn, self.kwargs = fn, dict(kwargs)

    def forward(self, *args):
        return self.fn(*args, **self.kwargs)


def automatic_dims(dynamic_shapes: Any) -> Any:
    """Named ``torch.export.Dim``s replaced by ``Dim.DYNAMIC`` with the same bounds.

    Under torch 2.11 a named sequence dim fails export with "Constraints violated" on guards such
    as ``min(8*s, 16*s) == 8*s`` that hold for every size but that its solver cannot prove for the
    declared range; ``Dim.DYNAMIC`` keeps them as facts (export_to_gm does the same, see there).
    """
    from torch.export import Dim

    def convert(x: Any) -> Any:
        if isinstance(x, Dim):
            return Dim.DYNAMIC(min=x.min, max=x.max)
        return x

    if dynamic_shapes is None:
        return None
    return torch.utils._pytree.tree_map(convert, dynamic_shapes, is_leaf=lambda x: isinstance(x, Dim))


def export_graph_module(
    fn: Callable[..., Any] | torch.nn.Module,
    args: Sequence[Any],
    *,
    kwargs: Optional[Mapping[str, Any]] = None,
    dynamic_shapes: Any = None,
) -> fx.GraphModule:
    """``torch.export`` (non-strict) of a function or module -> GraphModule without export's
    runtime guards and metadata asserts, like ``export_to_gm`` leaves the model graph.

    ``kwargs`` are bound into a function (not exported as inputs).
    """
    mod = fn if isinstance(fn, torch.nn.Module) else _FnModule(fn, kwargs or {})
    if not isinstance(fn, torch.nn.Module) and isinstance(dynamic_shapes, (list, tuple)):
        dynamic_shapes = (tuple(dynamic_shapes),)  # the wrapper's forward takes *args
    dynamic_shapes = automatic_dims(dynamic_shapes)
    with torch.no_grad():
        ep = torch.export.export(mod, tuple(args), dynamic_shapes=dynamic_shapes, strict=False)
    gm = ep.module()
    remove_tensor_metadata_asserts(gm)
    remove_input_checks(gm)
    # Export keeps full slices (x[:, None]) of dims it cannot bound; the pipeline's
    # cleanup_noop_slice removes them before any matcher runs, so graphs here look the same.
    remove_noop_slices(gm)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


__all__ = ["automatic_dims", "export_graph_module"]
