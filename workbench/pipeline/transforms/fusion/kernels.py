"""Stage ``post_load_fusion``: canonical ops -> backend ops, one transform per family.

The pattern stage left model-independent ops; here each is swapped for the backend picked in its
transform's config (table and availability rules: ``workbench.ops.backends``; ``auto`` = Triton on
CUDA, torch on CPU):

* ``fuse_rmsnorm``  ``torch_rmsnorm(x, w, eps)`` -> ``triton_rmsnorm`` | ``flashinfer_rmsnorm``
  (``torch`` keeps the canonical op, which *is* the torch backend: 0 rewrites);
* ``fuse_rope``     ``torch_rope_with_explicit_cos_sin(q, k, cos, sin, dim)`` -> the Triton kernel;
* ``fuse_swiglu``   ``torch_swiglu_mlp(x, Wg, Wu, Wd, bg, bu, bd)`` ->
                    ``linear(silu_and_mul(linear(x, cat[Wg; Wu], cat[bg; bu])), Wd, bd)``:
                    one gate/up GEMM over weights concatenated once here (memory accounting as in
                    ``fuse_gemms``), then the backend's ``*_silu_and_mul``; and a gate/up GEMM
                    ``fuse_gemms`` already made (quantized linears never become ``torch_swiglu_mlp``):
                    ``silu(split(y)[0]) * split(y)[1]`` -> ``*_silu_and_mul(y)``;
* ``fuse_gemms``    (``fuse_gemms.py``) linears sharing an input -> one GEMM + split (Q/K/V).

Every rewrite keeps the op's contract, so numerics equal the canonical op's (fp32: to rounding).
A node a backend cannot take (say FlashInfer with a weight dtype unlike the input's) stays
canonical and is listed in ``details['left']`` with the reason.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Literal, Optional, Tuple, TypeVar, Union

import torch
import torch.fx as fx
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.backends import choose_fusion_backend
from ....ops.flashinfer_support import FLASHINFER_DTYPES
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...graph.weights import LINEAR, concat_weights, fake_value, fetch_attr, param_of, release_weights
from ...interface import Transform, TransformConfig, TransformInfo, register, rewrite_info
from ...matcher import annotate_new_nodes, erase_dead, named_args

wb = torch.ops.workbench
aten = torch.ops.aten


def swap_node(
    gm: fx.GraphModule, node: fx.Node, target: Callable, args: tuple, kwargs: Optional[Dict[str, Any]] = None
) -> fx.Node:
    """Replace ``node`` by a call to ``target`` (new name, provenance, fake value)."""
    g = gm.graph
    with g.inserting_before(node):
        new = g.call_function(target, args, kwargs or {})
    annotate_new_nodes(gm, [new], [node.name], anchor=node)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new


# ------------------------------------------------------------------------------ RMSNorm


class FuseRMSNormConfig(TransformConfig):
    backend: Literal["auto", "torch", "triton", "flashinfer", "cpu"] = Field(
        default="auto",
        description="RMSNorm backend: auto (triton on CUDA, the C++ kernel on CPU where it builds, else "
        "torch) | torch (keep the canonical op) | triton | flashinfer (GPU only, optional extra) | cpu.",
    )


def _rmsnorm_refusal(backend: str, node: fx.Node) -> Optional[str]:
    x, w = tensor_meta(node.args[0]), tensor_meta(node.args[1])
    if x is None or w is None:
        return "no fake value on input/weight (run shape propagation first)"
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        return f"weight shape {list(w.shape)} is not [hidden]"
    if backend == "flashinfer" and x.dtype not in FLASHINFER_DTYPES:
        return f"flashinfer takes float16 or bfloat16, not {x.dtype}"
    if backend == "flashinfer" and w.dtype != x.dtype:
        return f"flashinfer needs weight dtype == input dtype ({w.dtype} vs {x.dtype})"
    return None


_SwapConfigT = TypeVar("_SwapConfigT", bound="Union[FuseRMSNormConfig, FuseRoPEConfig]")


class _SwapCanonicalOp(Transform[_SwapConfigT]):
    """Swap every call of a canonical op for the picked backend's op (same arguments, same
    contract); nodes the backend cannot take stay canonical, listed in ``details['left']``."""

    family: str = ""  # FUSION_BACKENDS table
    canonical: Any = None  # the torch op, an OpOverload (it *is* the torch backend)
    missing_note: str = ""

    def refusal(self, backend: str, node: fx.Node) -> Optional[str]:
        return None

    def swap(self, gm: fx.GraphModule, node: fx.Node, op: Callable, details: Dict[str, Any]) -> None:
        swap_node(gm, node, op, tuple(node.args), dict(node.kwargs))

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        nodes = call_nodes(gm, self.canonical)
        if not nodes:
            return rewrite_info(gm, 0, {"note": self.missing_note})
        choice = choose_fusion_backend(self.family, self.config.backend, ctx.device, f"{self.key}.backend")
        backend, why = choice.backend, choice.why
        details: Dict[str, Any] = {"backend": backend.name, "why": why, "candidates": len(nodes)}
        if backend.name == "torch":
            details["note"] = f"{self.canonical._schema.name.split('::')[-1]} is the torch backend: nothing to swap"
            return rewrite_info(gm, 0, details)
        left, n = {}, 0
        for node in nodes:
            refusal = self.refusal(backend.name, node)
            if refusal:
                left[node.name] = refusal
                continue
            self.swap(gm, node, backend.op, details)
            n += 1
        details["left"] = left
        return rewrite_info(gm, n, details)


@register("fuse_rmsnorm")
class FuseRMSNorm(_SwapCanonicalOp[FuseRMSNormConfig]):
    """Swap ``torch_rmsnorm`` for the configured backend's fused RMSNorm op."""

    family, canonical = "rmsnorm", wb.torch_rmsnorm.default
    missing_note = "no torch_rmsnorm nodes (run the pattern_matcher stage first)"

    def refusal(self, backend: str, node: fx.Node) -> Optional[str]:
        return _rmsnorm_refusal(backend, node)


# ------------------------------------------------------------------------------ RoPE


class FuseRoPEConfig(TransformConfig):
    backend: Literal["auto", "torch", "triton", "cpu"] = Field(
        default="auto",
        description="RoPE backend for torch_rope_with_explicit_cos_sin: auto (triton on CUDA, the C++ "
        "kernel on CPU where it builds, else torch) | torch (keep the canonical op) | triton | cpu.",
    )


def _rope_refusal(args: Dict[str, Any]) -> Optional[str]:
    q, k, cos, sin = (tensor_meta(args[name]) for name in ("q", "k", "cos", "sin"))
    if q is None or k is None or cos is None or sin is None:
        return "no fake value on q/k/cos/sin (run shape propagation first)"
    dim = args["unsqueeze_dim"]
    if dim not in (1, 2):
        return f"unsqueeze_dim={dim} (the kernel reads bsnd=2 or bnsd=1)"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return f"q/k must be 4-D and cos/sin 3-D, got {q.dim()}, {k.dim()}, {cos.dim()}, {sin.dim()}"
    d = q.shape[-1]
    if not isinstance(d, int) or d % 2 or k.shape[-1] != d or cos.shape[-1] != d or sin.shape[-1] != d:
        return f"head dims q={q.shape[-1]} k={k.shape[-1]} cos={cos.shape[-1]} must be one even static size"
    return None


@register("fuse_rope")
class FuseRoPE(_SwapCanonicalOp[FuseRoPEConfig]):
    """Swap ``torch_rope_with_explicit_cos_sin`` for the configured backend's RoPE op."""

    family, canonical = "rope", wb.torch_rope_with_explicit_cos_sin.default
    missing_note = "no torch_rope_with_explicit_cos_sin nodes"

    def refusal(self, backend: str, node: fx.Node) -> Optional[str]:
        return _rope_refusal(dict(named_args(node)))

    def swap(self, gm: fx.GraphModule, node: fx.Node, op: Callable, details: Dict[str, Any]) -> None:
        args = dict(named_args(node))
        swap_node(gm, node, op, (args["q"], args["k"], args["cos"], args["sin"], args["unsqueeze_dim"]))
        layouts = details.setdefault("layouts", {"bsnd": 0, "bnsd": 0})
        layouts["bsnd" if args["unsqueeze_dim"] == 2 else "bnsd"] += 1


# ------------------------------------------------------------------------------ SwiGLU


class FuseSwiGLUConfig(TransformConfig):
    backend: Literal["auto", "torch", "triton", "cpu"] = Field(
        default="auto",
        description="SiLU-and-mul backend after the fused gate/up GEMM: auto (triton on CUDA, the C++ "
        "kernel on CPU where it builds, else torch) | torch (torch_silu_and_mul) | triton (triton_silu_and_mul) "
        "| cpu (cpu_silu_and_mul).",
    )


def _swiglu_refusal(gm: fx.GraphModule, args: Dict[str, Any]) -> Optional[str]:
    g, u = param_of(gm, args["gate_weight"]), param_of(gm, args["up_weight"])
    if g is None or u is None:
        return "gate/up weights are not module attributes (nothing to concatenate at load time)"
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        return f"gate {list(g.shape)} {g.dtype} and up {list(u.shape)} {u.dtype} differ"
    gb, ub = args["gate_bias"], args["up_bias"]
    if (gb is None) != (ub is None):
        return "only one of gate/up has a bias"
    if gb is not None:
        b1, b2 = param_of(gm, gb), param_of(gm, ub)
        if b1 is None or b2 is None or b1.dtype != b2.dtype:
            return "gate/up biases are not module attributes of one dtype"
    return None


def fuse_swiglu_node(gm: fx.GraphModule, node: fx.Node, silu_mul: Callable) -> Dict[str, Any]:
    """``torch_swiglu_mlp`` -> gate/up GEMM (concatenated weights) + ``silu_mul`` + down GEMM."""
    args = dict(named_args(node))
    g = gm.graph
    pairs = [(args["gate_weight"], args["up_weight"])]
    if args["gate_bias"] is not None:
        pairs.append((args["gate_bias"], args["up_bias"]))
    fused_nodes, new_bytes = [], 0
    with g.inserting_before(node):
        for gate, up in pairs:
            target, nbytes = concat_weights(gm, [gate, up])
            new_bytes += nbytes
            attr = g.get_attr(target)
            attr.meta["val"] = fake_value(gm, fetch_attr(gm, target))
            fused_nodes.append(attr)
        gate_up = g.call_function(LINEAR, (args["input"], *fused_nodes))
        act = g.call_function(silu_mul, (gate_up,))
        down = (act, args["down_weight"]) + ((args["down_bias"],) if args["down_bias"] is not None else ())
        out = g.call_function(LINEAR, down)
    annotate_new_nodes(gm, [*fused_nodes, gate_up, act, out], [node.name], anchor=node)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return {"new_bytes": new_bytes, "originals": [n.target for pair in pairs for n in pair]}


def split_silu_mul(node: fx.Node) -> Optional[fx.Node]:
    """The input ``x`` when ``node`` is ``silu(x[..., :I]) * x[..., I:]`` spelled as ``fuse_gemms``
    leaves a fused gate/up GEMM (``split_with_sizes(x, [I, I], -1)``, two getitems, silu, mul; no
    other readers of the pieces), else None."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    for act, up in (node.args, node.args[::-1]):
        if not (isinstance(act, fx.Node) and act.target is aten.silu.default and isinstance(up, fx.Node)):
            continue
        gate = act.args[0]
        if not (isinstance(gate, fx.Node) and gate.target is operator.getitem and up.target is operator.getitem):
            continue
        split = gate.args[0]
        if (
            split is not up.args[0]
            or split.target is not aten.split_with_sizes.default
            or (gate.args[1], up.args[1]) != (0, 1)
        ):
            continue
        sizes, dim = split.args[1], (split.args[2] if len(split.args) > 2 else 0)
        x_val = split.args[0].meta.get("val")
        last = dim == -1 or (x_val is not None and dim == x_val.dim() - 1)
        if (
            len(sizes) == 2
            and sizes[0] == sizes[1]
            and last
            and len(split.users) == 2
            and len(gate.users) == 1
            and len(act.users) == 1
            and len(up.users) == 1
        ):
            return split.args[0]
    return None


def fuse_split_silu_mul(gm: fx.GraphModule, silu_mul: Callable) -> int:
    """Every ``split_silu_mul`` pattern -> ``silu_mul(x)``: 5 nodes -> 1 per MLP, one kernel."""
    g, n = gm.graph, 0
    for node in list(g.nodes):
        x = split_silu_mul(node) if node.op == "call_function" else None
        if x is None:
            continue
        with g.inserting_before(node):
            fused = g.call_function(silu_mul, (x,))
        annotate_new_nodes(gm, [fused], [node.name], anchor=node)
        node.replace_all_uses_with(fused)
        act, up = node.args if node.args[0].target is aten.silu.default else node.args[::-1]
        gate, split = act.args[0], act.args[0].args[0]
        erase_dead(g, [node, act, gate, up, split])
        n += 1
    return n


@register("fuse_swiglu")
class FuseSwiGLU(Transform[FuseSwiGLUConfig]):
    """``torch_swiglu_mlp`` -> fused gate/up GEMM + the configured backend's SiLU-and-mul; and a gate/up
    GEMM already fused by ``fuse_gemms`` (quantized linears: ``split -> silu * mul``) -> the SiLU-and-mul."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        nodes = call_nodes(gm, wb.torch_swiglu_mlp.default)
        if not nodes and not any(n.op == "call_function" and split_silu_mul(n) is not None for n in gm.graph.nodes):
            return rewrite_info(
                gm,
                0,
                {
                    "note": "no torch_swiglu_mlp nodes (run match_swiglu_pattern first) and "
                    "no fused gate/up GEMM followed by silu * mul"
                },
            )
        choice = choose_fusion_backend("silu_mul", self.config.backend, ctx.device, f"{self.key}.backend")
        backend, why = choice.backend, choice.why
        if not nodes:
            n = fuse_split_silu_mul(gm, backend.op)
            return rewrite_info(gm, n, {"backend": backend.name, "why": why, "fused_gate_up_silu_mul": n})
        left, done = {}, []
        for node in nodes:
            refusal = _swiglu_refusal(gm, dict(named_args(node)))
            if refusal:
                left[node.name] = refusal
                continue
            done.append(fuse_swiglu_node(gm, node, backend.op))
        released = release_weights(gm, [t for d in done for t in d["originals"]])
        details = {
            "backend": backend.name,
            "why": why,
            "candidates": len(nodes),
            "left": left,
            "new_bytes": sum(d["new_bytes"] for d in done),
            "freed_bytes": released.freed_bytes,
            "kept_originals": released.kept + released.tied,
        }
        return rewrite_info(gm, len(done), details)


__all__ = ["FuseRMSNorm", "FuseRoPE", "FuseSwiGLU", "swap_node", "fuse_swiglu_node"]
