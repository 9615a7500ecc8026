"""Stage ``compile``: run independent branches on an auxiliary CUDA stream.

``multi_stream_moe`` (shared expert || routed experts), ``multi_stream_mla_attn`` (MLA KV path ||
Q path) and ``multi_stream_gemm`` (largest of several GEMMs on one input || the others) all do the
same rewrite of one *branch*: a set of nodes with a single tensor input ``x`` whose results are
consumed later on the main stream::

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
and checked numerically on CPU; by default every transform here reports skipped off CUDA.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.library import ops_with
from ...context import PipelineContext
from ...graph.weights import param_of
from ...interface import Transform, TransformInfo, register
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


def _ancestors(node: fx.Node) -> Set[fx.Node]:
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


def _branch_input(branch: Sequence[fx.Node]) -> Optional[fx.Node]:
    inside = set(branch)
    ins = {a for n in branch for a in _inputs(n) if a not in inside and _is_tensor(a)}
    return next(iter(ins)) if len(ins) == 1 else None


# ------------------------------------------------------------------------------ MoE

MOE_OPS = ("torch_moe", "torch_moe_fused", "torch_moe_dense_mlp")
# linear spellings with (input, weight [N, K], bias): aten's, ours, and the CPU decode GEMM
LINEAR_OPS = ("linear", "torch_linear_simple", "cpu_linear_wxt", "cpu_linear")
# quantized linears with (input, weight, ...): the weight (codes) is arg 1, so its element count
# orders GEMMs of one format by size. FP8 first: the reference's multi_stream_gemm targets them.
QUANTIZED_LINEAR_OPS = (
    "torch_fp8_linear",
    "torch_finegrained_fp8_linear",
    "torch_nvfp4_linear",
    "torch_int4_linear",
    "torch_int8_linear",
    "torch_int4_awq_linear",
    "torch_int4_gptq_linear",
    "cpu_int4_linear",
    "cpu_int4_linear_a8",
    "cpu_int8_linear",
)
GEMM_OPS = (*LINEAR_OPS, *QUANTIZED_LINEAR_OPS, "mm", "matmul", "bmm", "torch_swiglu_mlp")
PASS_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.alias.default,
}


def _op_is(node: fx.Node, names: Sequence[str]) -> bool:
    t = node.target
    return (
        node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.name.split("::")[-1] in names
    )


@register("multi_stream_moe")
class MultiStreamMOE(MultiStreamTransform):
    """Shared expert on the aux stream while the routed experts run on the main stream.

    Site: ``add(routed, shared)`` where ``routed`` is a MoE op's output (through views/casts) and
    ``shared`` is computed by nodes that feed only that add, from the MoE's token input (or any one
    tensor computed before it), with at least one GEMM (the shared expert MLP, its gate...).
    """

    what = "running the shared expert beside the routed experts"

    def sites(self, gm):
        found = []
        for moe in [n for n in gm.graph.nodes if _op_is(n, MOE_OPS)]:
            cur = moe
            while len(cur.users) == 1 and next(iter(cur.users)).target in PASS_OPS:
                cur = next(iter(cur.users))
            add = next(iter(cur.users)) if len(cur.users) == 1 else None
            if add is None or add.target is not aten.add.Tensor or len(add.args) < 2:
                continue
            shared = add.args[1] if add.args[0] is cur else add.args[0]
            if not isinstance(shared, fx.Node):
                continue
            branch = exclusive_branch(shared, add, _ancestors(moe) | {moe})
            x = _branch_input(branch)
            if shared in branch and x is not None and any(_op_is(n, GEMM_OPS) for n in branch):
                found.append((moe.name, branch, x, []))
        return found


# ------------------------------------------------------------------------------ GEMMs


@register("multi_stream_gemm")
class MultiStreamGemm(MultiStreamTransform):
    """For each tensor read by 2+ GEMMs with parameter weights, the largest (by weight size) runs
    on the aux stream while the others run on the main stream. GEMMs are plain linears (fused ones
    included: ``fuse_gemms`` leaves one linear per input, so they pair with another format's or a
    router's GEMM on that input) and quantized linears (FP8 first: ``fuse_gemms`` does not
    concatenate per-tensor-scaled FP8 weights, so Q/K/V and gate/up stay siblings)."""

    what = "overlapping GEMMs that share an input"

    def sites(self, gm):
        by_input: Dict[fx.Node, List[Tuple[int, fx.Node]]] = {}
        for n in gm.graph.nodes:
            if _op_is(n, LINEAR_OPS + QUANTIZED_LINEAR_OPS) and len(n.args) >= 2:
                w = param_of(gm, n.args[1])
                if w is not None and isinstance(n.args[0], fx.Node):
                    by_input.setdefault(n.args[0], []).append((w.numel(), n))
        found = []
        for x, gemms in by_input.items():
            if len(gemms) >= 2:
                largest = max(gemms, key=lambda p: p[0])[1]  # first of equals (max is stable)
                found.append((largest.name, [largest], x, [n for _, n in gemms if n is not largest]))
        return found


# ------------------------------------------------------------------------------ MLA

def rms_norm_ops() -> Tuple[str, ...]:
    """Every RMSNorm op and backend, as they declare themselves (``OpTraits.norm``)."""
    return tuple(ops_with(lambda t: t.norm == "rms"))


SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.slice.Tensor}
VIEW_OPS = PASS_OPS | SPLITS | {operator.getitem}


def _low_rank_kv(norm: fx.Node) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """MLA's signature: linear (kv_a) -> views/split -> RMSNorm -> linear (kv_b).
    Returns (kv_a, path from kv_a to the norm) or None."""
    path, cur = [], norm.args[0]
    while isinstance(cur, fx.Node) and cur.target in VIEW_OPS:
        path.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node) or not _op_is(cur, LINEAR_OPS):
        return None
    nxt = norm
    while len(nxt.users) == 1 and next(iter(nxt.users)).target in VIEW_OPS:
        nxt = next(iter(nxt.users))
    if not any(_op_is(u, LINEAR_OPS) and u.args[0] is nxt for u in nxt.users):
        return None
    return cur, list(reversed(path))


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


@register("multi_stream_mla_attn")
class MultiStreamMLAAttn(MultiStreamTransform):
    """MLA: the low-rank KV path on the aux stream while the Q path runs on the main stream.

    Pattern 0 (unfused Q/KV GEMMs): the hidden state feeds the KV down-projection and another
    linear (Q); the whole KV path (kv_a -> norm -> kv_b -> splits) forks at the hidden state.
    Pattern 1 (fallback, after ``fuse_gemms`` fused q_a and kv_a): the KV path forks at the KV part
    of the fused GEMM's split and overlaps the Q chain (q norm -> q_b).
    """

    what = "overlapping the MLA KV path with the Q path"

    def sites(self, gm):
        found, pattern1 = [], []
        norms = rms_norm_ops()
        for norm in [n for n in gm.graph.nodes if _op_is(n, norms)]:
            sig = _low_rank_kv(norm)
            if sig is None:
                continue
            kv_a, path = sig
            x = kv_a.args[0]
            others = [u for u in x.users if u is not kv_a and _op_is(u, LINEAR_OPS)]
            if others and any(p.target in SPLITS for p in path):  # pattern 0: splits off k_pe
                found.append((f"{kv_a.name}:p0", forward_branch([kv_a], x), x, []))
            elif not others and path and path[0].target in SPLITS and len(kv_a.users) == 1:
                # pattern 1: kv_a is a fused [q_a | kv_a] GEMM; its KV part splits off k_pe later.
                split = path[0]
                kv_part = path[1] if split.target is aten.split_with_sizes.default and len(path) > 1 else split
                rest = path[path.index(kv_part) + 1 :]
                siblings = [u for u in (split.users if kv_part is not split else kv_a.users) if u is not kv_part]
                if siblings and any(p.target in SPLITS for p in rest):
                    pattern1.append((f"{kv_a.name}:p1", forward_branch(list(kv_part.users), kv_part), kv_part, []))
        return found or pattern1


__all__ = [
    "AuxStreams",
    "AuxFork",
    "AuxEnd",
    "AuxWait",
    "run_on_aux",
    "MultiStreamMOE",
    "MultiStreamGemm",
    "MultiStreamMLAAttn",
    "exclusive_branch",
    "forward_branch",
]
