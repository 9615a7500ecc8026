"""``fuse_causal_conv_activation`` (stage ``compile``): fold a SiLU into the cached causal conv op.

Mamba/SSM-style blocks run a short depthwise causal conv and then an activation (the canonical
forwards of ``models/canonical`` export it in that order, as HF spells it)::

    y = <cached causal conv op>(x, ..., activation=None)   [.., C, L] (whatever the op's layout)
    z = aten.silu(y)
    ->  z = <cached causal conv op>(x, ..., activation="silu")

so the conv kernel applies the activation while its output is still in registers (one memory
round trip less). Reshapes between the two (the cache stage's ``[1, T, c] -> [b, s, c]``) stay, after
the fused conv. The ops it rewrites are the cached causal-conv ops that ``insert_cached_causal_conv``
will produce (seed order: this runs after it, on the cached ops); their qualified names are the
``conv_ops`` config field, and only ops whose schema has an ``activation`` argument qualify. A
name that is not registered (no such op yet in this process) is ignored and listed in
``details['unregistered']``.

The fused-activation kernels are CUDA kernels, so on another device the transform reports
skipped with the reason and leaves the graph alone (``require_cuda: false`` applies the rewrite
anyway, which is how the CPU tests check it). A conv whose output feeds anything besides the SiLU,
or whose activation is already set, is left alone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from ...context import PipelineContext
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes, named_args
from .cuda_only import CudaOnlyConfig, cuda_skip_reason

aten = torch.ops.aten

# the cached conv ops ``insert_cached_causal_conv`` produces (both apply ``activation`` in the op)
DEFAULT_CONV_OPS = ("workbench::triton_cached_causal_conv1d", "workbench::torch_cached_causal_conv1d")
# Activation op in the graph -> the name the conv op's ``activation`` argument takes.
ACTIVATIONS = {aten.silu.default: "silu"}
# Shape-only ops an elementwise activation commutes with: the cache stage reshapes a cached op's
# flattened [1, T, c] output back to [b, s, c] before the activation reads it.
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _through_reshapes(node: fx.Node) -> Tuple[List[fx.Node], fx.Node]:
    """(the chain of single-user reshapes after ``node``, the node after them)."""
    chain, cur = [], node
    while len(cur.users) == 1:
        nxt = next(iter(cur.users))
        if nxt.op != "call_function" or nxt.target not in RESHAPES or nxt.args[:1] != (cur,):
            break
        chain.append(nxt)
        cur = nxt
    return chain, cur


class FuseCausalConvActivationConfig(CudaOnlyConfig):
    conv_ops: List[str] = Field(
        default=list(DEFAULT_CONV_OPS),
        description="Qualified names ('namespace::op') of cached causal-conv ops that take an "
        "'activation: Optional[str]' argument; names not registered in this process are ignored.",
    )


def resolve_conv_ops(names: List[str]) -> Tuple[List[Any], List[str]]:
    """(overloads with an ``activation`` argument, names that are not registered or lack it)."""
    found, missing = [], []
    for qual in names:
        ns, _, name = qual.partition("::")
        try:
            overload = getattr(getattr(torch.ops, ns), name).default
        except (AttributeError, RuntimeError):
            missing.append(qual)
            continue
        if any(a.name == "activation" for a in overload._schema.arguments):
            found.append(overload)
        else:
            missing.append(f"{qual} (no 'activation' argument)")
    return found, missing


def fuse_conv_activations(gm: fx.GraphModule, conv_ops: List[Any]) -> List[Tuple[str, str]]:
    """Rewrite every conv -> activation pair; returns (conv node, activation) per rewrite."""
    g, done = gm.graph, []
    for node in [n for n in g.nodes if n.op == "call_function" and n.target in conv_ops]:
        args = dict(named_args(node))
        if args.get("activation") is not None or len(node.users) != 1:
            continue
        reshapes, last = _through_reshapes(node)
        if len(last.users) != 1:
            continue
        act = next(iter(last.users))
        if act.op != "call_function" or act.target not in ACTIVATIONS or act.args[:1] != (last,):
            continue
        if len(act.args) != 1 or act.kwargs:
            continue
        names = [a.name for a in node.target._schema.arguments]
        idx = names.index("activation")
        new_args, new_kwargs = list(node.args), dict(node.kwargs)
        if idx < len(new_args):
            new_args[idx] = ACTIVATIONS[act.target]
        else:
            new_kwargs["activation"] = ACTIVATIONS[act.target]
        with g.inserting_before(node):
            fused = g.call_function(node.target, tuple(new_args), new_kwargs)
        annotate_new_nodes(gm, [fused], [node.name, act.name], anchor=node)
        # conv -> reshapes -> act  becomes  conv(act) -> reshapes: the reshapes now read the fused conv
        node.replace_all_uses_with(fused)
        act.replace_all_uses_with(reshapes[-1] if reshapes else fused)
        done.append((node.name, ACTIVATIONS[act.target]))
        g.erase_node(act)
        g.erase_node(node)
    return done


@register("fuse_causal_conv_activation")
class FuseCausalConvActivation(Transform[FuseCausalConvActivationConfig]):
    """Fuse the SiLU after a cached causal conv into the conv op (CUDA only)."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        if self.config.require_cuda:
            reason = cuda_skip_reason(ctx, "fusing activations into the cached causal-conv kernels")
            if reason:
                return gm, TransformInfo(skipped=True, skip_reason=reason)
        ops, missing = resolve_conv_ops(self.config.conv_ops)
        done = fuse_conv_activations(gm, ops) if ops else []
        if done:
            gm.graph.lint()
            gm.recompile()
        details: Dict[str, Any] = {"fused": [f"{c} + {a}" for c, a in done], "unregistered": missing}
        if not ops:
            details["note"] = "none of conv_ops is registered (no cached causal conv in this build)"
        return gm, TransformInfo(num_matches=len(done), is_clean=not done, has_valid_shapes=bool(done), details=details)


__all__ = ["FuseCausalConvActivation", "fuse_conv_activations", "resolve_conv_ops"]
