"""Moving one branch of a graph onto an auxiliary CUDA stream (``run_on_aux``), and the transform
base the ``multi_stream_*`` transforms (``multi_stream.py``) share (``MultiStreamTransform``).

A *branch* is a set of nodes with a single tensor input ``x`` whose results are consumed later on
the main stream::

    x ──► x' = aux_fork_i(x)      main records an event, aux waits on it; current stream := aux
          branch(x')              enqueued on the aux stream
          y' = aux_end_i(y)       aux records "done"; current stream := main
          ...main-stream work...  runs concurrently with the branch
          y" = aux_wait_i(y')     main waits on "done" (placed right before y's first consumer)
          consumer(y")

The three markers are small ``nn.Module``s (``call_module`` nodes, so the graph prints, copies and
renders like any other) that pass their tensors through unchanged; the data dependencies keep
them ordered if a later pass reorders nodes. They share one ``AuxStreams`` object per rewrite
(the aux stream, created on first use per device: no global state) and per-site CUDA events. The
fork calls ``x.record_stream(aux)`` and the wait ``y.record_stream(main)``, so the caching
allocator never hands a block to one stream while the other may still read it; all of it is legal
under CUDA-graph capture (the aux stream forks from and rejoins the capturing stream). On CPU
tensors the markers are pass-throughs, so ``require_cuda: false`` lets the rewrite be inspected
and checked numerically on CPU.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ...context import PipelineContext
from ...interface import Transform, TransformInfo
from ...matcher import annotate_new_nodes
from .aux_streams import AuxEnd, AuxFork, AuxSite, AuxStreams, AuxWait, passthrough
from .cuda_only import CudaOnlyConfig, cuda_skip_reason

aten = torch.ops.aten


# ------------------------------------------------------------------------------ the rewrite

COMPUTE_SKIP = {operator.getitem, aten.sym_size.int, aten.view.default, aten.reshape.default}


def _is_tensor(node: Any) -> bool:
    """Whether ``node`` carries tensor data other than a parameter (unknown counts as tensor)."""
    if not isinstance(node, fx.Node) or node.op == "get_attr" or node.target is aten.sym_size.int:
        return False
    val = node.meta.get("val")
    return val is None or isinstance(val, (torch.Tensor, tuple, list))


def _inputs(node: fx.Node) -> List[fx.Node]:
    return list(node.all_input_nodes)


def _call(gm: fx.GraphModule, name: str, module: torch.nn.Module, args: tuple, val: Any) -> fx.Node:
    i = 0
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    gm.add_submodule(f"{name}_{i}", module)
    node = gm.graph.call_module(f"{name}_{i}", args)
    node.meta["val"] = val
    return node


def _outputs_of(node: fx.Node, vals: List[Any], gm: fx.GraphModule) -> List[fx.Node]:
    """One node per tensor of a marker: the node itself, or getitems of its tuple."""
    if len(vals) == 1:
        return [node]
    items, prev = [], node
    for i, v in enumerate(vals):
        with gm.graph.inserting_after(prev):
            prev = gm.graph.call_function(operator.getitem, (node, i))
        prev.meta["val"] = v
        items.append(prev)
    return items


def branch_refusal(branch: Sequence[fx.Node], x: fx.Node) -> Optional[str]:
    """Why ``branch`` cannot move to the aux stream with ``x`` as its only tensor input."""
    inside = set(branch)
    for node in branch:
        if node.op != "call_function":
            return f"{node.name} is a {node.op} node"
        for a in _inputs(node):
            if a not in inside and a is not x and _is_tensor(a):
                return f"{node.name} reads tensor {a.name} besides the branch input {x.name}"
    return None


def run_on_aux(
    gm: fx.GraphModule,
    branch: Iterable[fx.Node],
    x: fx.Node,
    streams: AuxStreams,
    name: str,
    hoist: Sequence[fx.Node] = (),
) -> Dict[str, Any]:
    """Move ``branch`` (nodes reading only ``x``, parameters and scalars) to the aux stream.

    ``hoist``: main-stream nodes to move right after the fork/end pair (they must only read what
    exists at the fork), so they run while the branch does -- e.g. the sibling GEMMs of the moved
    one, which program order may have placed after its consumer. Returns what was done, or
    ``{"refused": reason}`` with the graph untouched.
    """
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    nodes = sorted(set(branch), key=order.__getitem__)
    why = branch_refusal(nodes, x)
    if why:
        return {"refused": why}
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs:
        return {"refused": "the branch has no consumer"}
    # The fork goes after x and after everything else (scalars, parameters) the branch reads.
    anchor = max([x] + [a for n in nodes for a in _inputs(n) if a not in inside], key=order.__getitem__)
    first_use = min((u for o in outputs for u in o.users if u not in inside), key=order.__getitem__)
    if order[anchor] >= order[first_use]:
        return {"refused": "the branch input is produced after its results are consumed"}
    hoist = [n for n in hoist if n not in inside and order[n] > order[anchor]]
    late = {a for n in hoist for a in _inputs(n) if order[a] > order[anchor]}
    if any(a.op != "get_attr" for a in late):
        return {"refused": "a node to run beside the branch reads something computed after its input"}
    # Parameters read by the hoisted nodes (a quantized sibling's scales, fetched where export put
    # them) depend on nothing: they move up before the fork's anchor.
    for a in sorted(late, key=order.__getitem__):
        anchor.prepend(a)
    overlap = [
        n
        for n in g.nodes
        if (order[anchor] < order[n] < order[first_use] or n in hoist)
        and n not in inside
        and n.op == "call_function"
        and n.target not in COMPUTE_SKIP
    ]
    if not overlap:
        return {"refused": "no main-stream work between the branch input and its first consumer"}

    site = AuxSite(streams, name)
    with g.inserting_after(anchor):
        fork = _call(gm, "aux_fork", AuxFork(site), (x,), x.meta.get("val"))
    for node in nodes:
        node.replace_input_with(x, fork)
    prev = fork
    for node in nodes:
        prev.append(node)
        prev = node
    vals = [o.meta.get("val") for o in outputs]
    with g.inserting_after(prev):
        end = _call(gm, "aux_end", AuxEnd(site), tuple(outputs), passthrough(tuple(vals)))
    ended = _outputs_of(end, vals, gm)
    prev = ended[-1]
    for node in sorted(hoist, key=order.__getitem__):
        prev.append(node)
        prev = node
    with g.inserting_before(first_use):
        wait = _call(gm, "aux_wait", AuxWait(site), tuple(ended), passthrough(tuple(vals)))
    waited = _outputs_of(wait, vals, gm)
    for out, w in zip(outputs, waited):
        out.replace_all_uses_with(w, delete_user_cb=lambda u: u not in inside and u is not end)
    items = (ended if len(ended) > 1 else []) + (waited if len(waited) > 1 else [])
    annotate_new_nodes(gm, items, [], anchor=outputs[0])
    return {
        "site": site.name,
        "input": x.name,
        "branch": [n.name for n in nodes],
        "outputs": [o.name for o in outputs],
        "overlaps": [n.name for n in overlap],
        "hoisted": [n.name for n in hoist],
    }


class MultiStreamTransform(Transform[CudaOnlyConfig]):
    """Shared ``_apply``: skip off CUDA, find (branch, input) sites, rewrite each."""

    what = "multi-stream execution"

    def sites(self, gm: fx.GraphModule) -> List[Tuple[str, List[fx.Node], fx.Node, List[fx.Node]]]:
        """(label, branch nodes, branch input, main-stream nodes to hoist beside it) per site."""
        raise NotImplementedError

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if self.config.require_cuda:
            reason = cuda_skip_reason(ctx, f"{self.what} (an auxiliary CUDA stream)")
            if reason:
                return gm, TransformInfo(skipped=True, skip_reason=reason)
        streams, done, refused = AuxStreams(), [], {}
        for label, branch, x, hoist in self.sites(gm):
            result = run_on_aux(gm, branch, x, streams, f"{self.key}:{label}", hoist)
            if "refused" in result:
                refused[label] = result["refused"]
            else:
                done.append(result)
        if done:
            gm.graph.lint()
            gm.recompile()
        # Markers carry their inputs' fake values; with no rewrite the incoming state stands.
        return gm, TransformInfo(
            num_matches=len(done),
            is_clean=not done,
            has_valid_shapes=bool(done),
            details={"sites": done, "refused": refused},
        )


def ancestors(node: fx.Node) -> Set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for a in _inputs(stack.pop()):
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def exclusive_branch(root: fx.Node, sink: fx.Node, stop: Set[fx.Node]) -> List[fx.Node]:
    """Nodes computing ``root`` whose results only feed ``sink`` (or each other); ``stop`` and
    non-call nodes bound the walk backwards."""
    cand, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n in cand or n in stop or n.op != "call_function":
            continue
        cand.add(n)
        stack.extend(_inputs(n))
    changed = True
    while changed:
        changed = False
        for n in list(cand):
            if any(u not in cand and u is not sink for u in n.users):
                cand.discard(n)
                changed = True
    return list(cand)


def branch_input(branch: Sequence[fx.Node]) -> Optional[fx.Node]:
    inside = set(branch)
    ins = {a for n in branch for a in _inputs(n) if a not in inside and _is_tensor(a)}
    return next(iter(ins)) if len(ins) == 1 else None


def forward_branch(start: Sequence[fx.Node], x: fx.Node) -> List[fx.Node]:
    """``start`` plus every later node computed only from it, ``x``, parameters and scalars."""
    branch, grew = set(start), True
    while grew:
        grew = False
        for n in list(branch):
            for u in n.users:
                if u in branch or u.op != "call_function":
                    continue
                if all(a in branch or a is x or not _is_tensor(a) for a in _inputs(u)):
                    branch.add(u)
                    grew = True
    return list(branch)


__all__ = [
    "MultiStreamTransform",
    "ancestors",
    "branch_input",
    "branch_refusal",
    "exclusive_branch",
    "forward_branch",
    "run_on_aux",
]
