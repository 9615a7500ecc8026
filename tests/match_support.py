"""The helpers the test_match_* files share: export a function, run one transform on it, check it,
count its ops (the matcher engine's own tests: ``test_matcher_engine.py``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx

from workbench.pipeline.graph.utils import op_histogram
from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages, TransformInfo
from workbench.pipeline.matcher import automatic_dims, export_graph_module

wb = torch.ops.workbench


# ------------------------------------------------------------------------------ shared helpers


def export(fn: Any, args: Sequence[torch.Tensor], dynamic: Optional[Dict[int, Dict[int, str]]] = None):
    """Export ``fn`` (function or module) with the given dims dynamic: {arg index: {dim: name}}."""
    dims: Dict[str, torch.export.Dim] = {}
    spec = None
    if dynamic:
        spec = tuple(
            {d: dims.setdefault(name, torch.export.Dim(name, min=2, max=64)) for d, name in dynamic.get(i, {}).items()}
            or None
            for i in range(len(args))
        )
    return export_graph_module(fn, args, dynamic_shapes=spec)


def run(key: str, gm: fx.GraphModule, **fields) -> tuple[fx.GraphModule, TransformInfo]:
    """Run one registered transform as the pipeline does (cleanup/shape flags included)."""
    cls = TRANSFORMS.get(key)
    cfg = cls.config_class(stage=Stages.PATTERN_MATCHER, **fields)
    before = op_histogram(gm)  # for ``gone``: the transform may rewrite gm in place
    out, info, _ = cls(cfg)(gm, None, GraphState(is_clean=True, has_valid_shapes=True))
    out.meta[OPS_BEFORE] = before
    return out, info


def check(
    key: str,
    fn: Any,
    args: Sequence[torch.Tensor],
    *,
    matches: int,
    dynamic: Optional[Dict[int, Dict[int, str]]] = None,
    other_args: Optional[Sequence[torch.Tensor]] = None,
    atol: float = 1e-6,
    **fields,
) -> fx.GraphModule:
    """Export ``fn``, run transform ``key``: ``matches`` matches, same numbers as before at the
    example and at ``other_args`` (another shape), and the result still exports. With
    ``matches=0`` the graph must be unchanged."""
    gm = export(fn, args, dynamic)
    before_code = gm.code
    refs = [gm(*a) for a in (args, other_args) if a is not None]
    out, info = run(key, gm, **fields)
    assert info.num_matches == matches, (info, out.graph)
    if matches == 0:
        assert out.code == before_code
    for a, ref in zip([x for x in (args, other_args) if x is not None], refs):
        torch.testing.assert_close(out(*a), ref, atol=atol, rtol=atol)
    spec = None
    if dynamic:
        dims: Dict[str, Any] = {}
        spec = tuple(
            {d: dims.setdefault(n, torch.export.Dim(n, min=2, max=64)) for d, n in dynamic.get(i, {}).items()}
            or None
            for i in range(len(args))
        )
    torch.export.export(out, tuple(args), dynamic_shapes=automatic_dims(spec), strict=False)  # still exports
    return out


#: ``out.meta`` key under which ``run`` keeps the op histogram of the graph it was given.
OPS_BEFORE = "test_ops_before"


def op_key(op: Any) -> str:
    """``op_histogram``'s name of ``op`` (an ``OpOverload`` or such a name), checked to name an op
    overload: ``count(gm, "<misspelt>") == 0`` would otherwise pass whatever the graph holds."""
    name = op if isinstance(op, str) else f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"
    parts = name.split(".")
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) != 3 or not isinstance(getattr(packet, parts[2]), torch._ops.OpOverload):
            raise AttributeError(name)
    except (AttributeError, IndexError, RuntimeError):
        raise ValueError(f"{name!r} names no op overload (spell it namespace.op.overload)") from None
    return name


def count(gm: torch.nn.Module, op: Any) -> int:
    """Nodes of ``gm`` calling ``op`` (an ``OpOverload`` or its name, ``"aten.rsqrt.default"``)."""
    return op_histogram(gm).get(op_key(op), 0)


def gone(gm: torch.nn.Module, op: Any) -> bool:
    """``op`` was in the graph ``run`` was given and is not in its result ``gm`` (vLLM's
    check-before-ops: an assertion that an op is gone must be able to fail)."""
    name = op_key(op)
    before = gm.meta.get(OPS_BEFORE)
    if before is None:
        raise KeyError("gone(): this graph did not come from match_support.run/check (no op counts from before)")
    assert before.get(name, 0) > 0, f"{name} was not in the graph before the transform: 'gone' cannot fail"
    return count(gm, name) == 0


def all_gone(gm: torch.nn.Module, ops: Sequence[Any]) -> bool:
    """Of ``ops`` (alternatives: spellings a graph may hold), at least one was in the graph ``run``
    was given, and none of those is left in ``gm``."""
    before = gm.meta.get(OPS_BEFORE)
    if before is None:
        raise KeyError("all_gone(): this graph did not come from match_support.run/check (no op counts from before)")
    present = [op for op in ops if before.get(op_key(op), 0)]
    assert present, f"none of {list(ops)} was in the graph before the transform: 'all_gone' cannot fail"
    return all(gone(gm, op) for op in present)
