"""Stage ``compile``: run independent branches on an auxiliary CUDA stream.

``multi_stream_moe`` (shared expert || routed experts), ``multi_stream_mla_attn`` (MLA KV path ||
Q path) and ``multi_stream_gemm`` (largest of several GEMMs on one input || the others) each find
their sites -- a *branch* with a single tensor input ``x`` whose results are consumed later on the
main stream -- and all do the same rewrite of it (``aux_branch.run_on_aux``: fork, branch on the aux
stream, end, main-stream work, wait). By default every transform here reports skipped off CUDA;
``require_cuda: false`` lets the rewrite be inspected and checked numerically on CPU.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.library import ops_with
from ...graph.weights import param_of
from ...interface import register
from .aux_branch import MultiStreamTransform, ancestors, branch_input, exclusive_branch, forward_branch

aten = torch.ops.aten


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
            branch = exclusive_branch(shared, add, ancestors(moe) | {moe})
            x = branch_input(branch)
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


__all__ = ["MultiStreamMOE", "MultiStreamGemm", "MultiStreamMLAAttn", "rms_norm_ops"]
