"""``insert_cached_attention`` (stage ``cache_init``): canonical attention -> paged cached attention.

Every ``torch.ops.workbench.torch_attention`` node becomes the backend's cached op::

    torch_attention(q, k, v, is_causal=True, scale, sliding_window, logit_cap, sinks, layout, alibi_slopes, chunk_size)
      q [b, s, Hq, D] (bsnd) or [b, Hq, s, D] (bnsd)
    ->  reshape to flattened tokens: q [1, b*s, Hq, D], k/v [1, b*s, Hkv, D]
        <backend>_cached_attention(q, k, v, k_cache_<i>, v_cache_<i>, seq_lens, input_pos,
                                   page_table, num_prefill, scale, sliding_window, logit_cap, sinks,
                                   alibi_slopes, chunk_size)
        reshape back to q's layout [b, s, Hq, Dv] / [b, Hq, s, Dv]

and the graph gains the metadata inputs (shared by all layers) and one K and one V page pool per
layer (see ``inputs.py``). The runtime feeds ``input_ids [1, T]`` -- the whole step's tokens
flattened -- so the reshapes are views; a ``[b, s]`` batch of b fresh prefill sequences also
works unchanged (that is how the numerics probe runs). Allocation happens later
(``initialize_cache``): this transform only declares ``CacheSpec``s (``ctx.cache.declare``).

Backends: ``workbench.ops.backends.ATTENTION_BACKENDS`` (``torch`` reference, CPU and GPU;
``cpu``: the C++ kernel; ``triton``: GPU, or CPU under ``TRITON_INTERPRET=1``; ``flashinfer``: GPU
only, optional extra), picked when the transform runs (``pipeline.attention_backend``: ``auto`` takes
the first that runs on the device and serves every layer), each with a reason when it cannot run or
cannot take the shape.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....runtime.interface import PAGED, CacheSpec
from ...context import CACHE_SPECS, PipelineContext
from ...graph.utils import call_nodes, require_tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes, named_args, same_size
from ...matcher.masks import classify_mask
from .attention_backend import InsertCachedAttentionConfig, LayerShape, resolve_backend
from .inputs import cache_input, metadata_inputs

aten = torch.ops.aten


# ------------------------------------------------------------------------------ the rewrite


def _attention_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return call_nodes(gm, torch.ops.workbench.torch_attention.default)


def _unsupported(args: Dict[str, Any]) -> Optional[str]:
    """Why a torch_attention call cannot become cached attention, or None."""
    if args["attn_mask"] is not None:
        return "it has an explicit attn_mask (only causal, sliding-window and chunked masking can be cached)"
    if not args["is_causal"]:
        return "it is not causal (a KV cache serves autoregressive decoding only)"
    if args["dropout_p"]:
        return f"dropout_p={args['dropout_p']} (inference only)"
    return None


def classify_loaded_masks(nodes: List[fx.Node]) -> int:
    """Explicit masks that turn out causal now that the weights are loaded: a mask read from a table
    the model registers (GPT-Neo's and OpenAI GPT's causal ``bias``, ``attention/legacy.py``) was
    meta when the pattern matcher saw it. Each becomes ``is_causal`` (+ ``sliding_window``) as the
    matcher would have made it; returns how many."""
    n = 0
    for node in nodes:
        args = dict(named_args(node))
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or "attn_mask" not in node.kwargs or args["is_causal"]:
            continue
        q, k = require_tensor_meta(args["query"]), require_tensor_meta(args["key"])
        seq = 2 if args["layout"] == "bnsd" else 1
        if not same_size(q.shape[seq], k.shape[seq]):
            continue  # not self-attention over the same positions
        kind = classify_mask(mask, q.shape[seq])
        if kind is None:
            continue
        kwargs = {**node.kwargs, "attn_mask": None, "is_causal": kind.is_causal}
        if kind.sliding_window is not None:
            kwargs["sliding_window"] = kind.sliding_window
        if kind.chunk_size is not None:
            kwargs["chunk_size"] = kind.chunk_size
        node.kwargs = kwargs
        n += 1
    if n:
        nodes[0].graph.eliminate_dead_code()  # the masks' sub-graphs
    return n


def rewrite_attention(
    gm: fx.GraphModule, node: fx.Node, layer: int, op: Callable, meta: Dict[str, fx.Node], device: torch.device
) -> Tuple[CacheSpec, CacheSpec]:
    """Replace one ``torch_attention`` node; returns the K and V cache specs it reads."""
    args = dict(named_args(node))
    why = _unsupported(args)
    if why:
        raise ValueError(f"cannot cache attention node {node.name} (layer {layer}): {why}")
    bnsd = args["layout"] == "bnsd"
    q, k, v = args["query"], args["key"], args["value"]
    qv, kv, vv = require_tensor_meta(q), require_tensor_meta(k), require_tensor_meta(v)
    hq, d = (qv.shape[1], qv.shape[3]) if bnsd else (qv.shape[2], qv.shape[3])
    hkv = kv.shape[1] if bnsd else kv.shape[2]
    dv = vv.shape[3]
    if not all(isinstance(x, int) for x in (hq, hkv, d, dv)):
        raise ValueError(f"attention node {node.name}: head counts/dims must be static, got {hq}, {hkv}, {d}, {dv}")
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(d)
    k_spec = CacheSpec(f"k_cache_{layer}", PAGED, (hkv, d), None, layer)
    v_spec = CacheSpec(f"v_cache_{layer}", PAGED, (hkv, dv), None, layer)
    k_cache = cache_input(gm, k_spec, kv.dtype, device)
    v_cache = cache_input(gm, v_spec, vv.dtype, device)

    g = gm.graph
    before = set(g.nodes)
    with g.inserting_before(node):

        def flat(x: fx.Node, heads: int, dim: int) -> fx.Node:
            if bnsd:  # [b, h, s, d] -> [b, s, h, d]
                x = g.call_function(aten.transpose.int, (x, 1, 2))
            return g.call_function(aten.reshape.default, (x, [1, -1, heads, dim]))

        qf, kf, vf = flat(q, hq, d), flat(k, hkv, d), flat(v, hkv, dv)
        out = g.call_function(
            op,
            (
                qf,
                kf,
                vf,
                k_cache,
                v_cache,
                meta["seq_lens"],
                meta["input_pos"],
                meta["page_table"],
                meta["num_prefill"],
                float(scale),
            ),
            {
                "sliding_window": args["sliding_window"],
                "logit_cap": args["logit_cap"],
                "sinks": args["sinks"],
                # chunked local attention only where the canonical op has it (other graphs unchanged)
                **({"chunk_size": args["chunk_size"]} if args["chunk_size"] is not None else {}),
                # ALiBi slopes ([Hq] graph constant) likewise
                **({"alibi_slopes": args["alibi_slopes"]} if args["alibi_slopes"] is not None else {}),
            },
        )
        # Back to q's own [b, s] (or [b, h, s]) shape: sizes read from q itself.
        b = g.call_function(aten.sym_size.int, (q, 0))
        s = g.call_function(aten.sym_size.int, (q, 2 if bnsd else 1))
        res = g.call_function(aten.reshape.default, (out, [b, s, hq, dv]))
        if bnsd:
            res = g.call_function(aten.transpose.int, (res, 1, 2))
    node.replace_all_uses_with(res)
    # Provenance, fake values, and the attention node's module stack (viz groups by layer).
    annotate_new_nodes(gm, [n for n in g.nodes if n not in before], [node.name], anchor=node)
    g.erase_node(node)
    return k_spec, v_spec


def layer_shapes(nodes: List[fx.Node]) -> List[LayerShape]:
    """Each canonical attention node's shape facts, as the backends' ``unsupported`` hooks take them."""
    shapes = []
    for layer, node in enumerate(nodes):
        args = dict(named_args(node))
        qv, vv = require_tensor_meta(args["query"]), require_tensor_meta(args["value"])
        shapes.append(
            LayerShape(
                layer,
                int(qv.shape[-1]),
                int(vv.shape[-1]),
                qv.dtype,
                args["sinks"] is not None,
                args["chunk_size"],
                has_alibi=args["alibi_slopes"] is not None,
            )
        )
    return shapes


# Attention spelled in ops the cache cannot serve, and why each is left (see ``uncached_attention``).
_SDPA_LEFT = (
    "SDPA the pattern matcher did not canonicalize (an explicit mask, soft-capping, sinks or a layout it does not know)"
)
_EAGER_LEFT = "an eager softmax over q @ k^T (matmul + softmax attention the pattern matcher did not canonicalize)"
_SOFTMAX = (aten._softmax.default, aten.softmax.int)
_SCORES = (aten.matmul.default, aten.bmm.default, aten.einsum.default)
# what may stand between the q @ k^T product and the softmax: scaling, masking, soft-capping, casts,
# reshapes, a clamp, and for attention sinks the sink column concatenated and the row max subtracted
_ON_SCORES = (
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.tanh.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.cat.default,
    aten.where.self,
    # BART-style (XGLM): scores viewed [b * h, s, s] <-> [b, h, s, s] around the mask, clamped at finfo.min
    aten.view.default,
    aten.reshape.default,
    aten.max.other,
    aten.maximum.default,
)


def _softmax_over_scores(node: fx.Node, depth: int = 6) -> bool:
    """Whether a softmax's input is a matmul reached through elementwise score ops: attention, not the
    softmax of an MoE router (which reads a linear)."""
    x = node.args[0] if node.args else None
    for _ in range(depth):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
        if x.target in _SCORES:
            return True
        if x.target not in _ON_SCORES:
            return False
        if x.target is aten.where.self:  # where(visible, scores, fill): the scores are the middle one
            x = x.args[1]
            continue
        x = x.args[0][0] if x.target is aten.cat.default else x.args[0]  # cat([scores, sinks], -1)
    return False


def _module_of(node: fx.Node) -> str:
    """The HF module a node was traced in (``transformer.h.0.attn.attention``), from export's
    ``nn_module_stack``; '' when the node carries none (made by a transform)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path).removeprefix("L['self'].").removeprefix("model.")


def uncached_attention(gm: fx.GraphModule) -> Dict[str, str]:
    """Attention computations that no cached-attention op serves: node name -> why, and the module
    it was traced in. A graph with any of these runs without a KV cache for them: every decode step
    re-runs the whole sequence."""
    left: Dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.workbench.torch_attention.default:
            why = "canonical attention not made cached: " + (
                _unsupported(dict(named_args(node))) or "insert_cached_attention did not run on it"
            )
        elif node.target is aten.scaled_dot_product_attention.default:
            why = _SDPA_LEFT
        elif node.target in _SOFTMAX and _softmax_over_scores(node):
            why = _EAGER_LEFT
        else:
            continue
        module = _module_of(node)
        left[node.name] = f"{why} [in {module}]" if module else why
    return left


def _refuse_or_report(left: Dict[str, str], require: bool) -> str:
    """The warning for attention left uncached; raises instead when ``require_cached_attention``."""
    shown = "; ".join(f"{k}: {v}" for k, v in list(left.items())[:3]) + (
        f"; +{len(left) - 3} more" if len(left) > 3 else ""
    )
    text = (
        f"{len(left)} attention node(s) left without a KV cache -- generate re-runs the whole sequence "
        f"every step (uncached, full re-forward) -- {shown}"
    )
    if require:
        raise ValueError(
            text + ". Canonicalize them (see the pattern_matcher stage's matches) or set "
            "insert_cached_attention.require_cached_attention=false to run them uncached."
        )
    return text


@register("insert_cached_attention")
class InsertCachedAttention(Transform[InsertCachedAttentionConfig]):
    """Rewrite every canonical attention op into the backend's paged cached attention op."""

    provides = (CACHE_SPECS,)

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            raise TypeError(
                "insert_cached_attention rewrites exported graphs, and this model is not exported; "
                "for cached inference on the HF model use the transformers mode "
                "(detect_hf_attn_layers + transformers_replace_cached_attn)"
            )
        nodes = _attention_nodes(gm)
        if not nodes:
            left = uncached_attention(gm)
            if left:
                warning = _refuse_or_report(left, self.config.require_cached_attention)
                return gm, TransformInfo(
                    num_matches=0, skip_reason=warning, details={"uncached_attention": left, "warning": warning}
                )
            return gm, TransformInfo(
                num_matches=0, skip_reason="no torch_attention nodes (run the pattern_matcher stage first)"
            )
        names = {n.name for n in nodes}
        left = {k: v for k, v in uncached_attention(gm).items() if k not in names}
        if left:  # some layers would be cached and others not: those would attend to the new tokens only
            raise ValueError(
                f"{len(left)} attention node(s) are not canonical attention while {len(nodes)} are: a cached graph "
                f"would feed those layers only each step's new tokens (wrong results, not just slow): "
                + "; ".join(f"{k}: {v}" for k, v in list(left.items())[:3])
                + ". Canonicalize them in the pattern_matcher stage, or disable insert_cached_attention "
                "(and the cache stage) to run the model uncached."
            )
        classified = classify_loaded_masks(nodes)
        device = ctx.device
        # every layer's shape is checked before the graph changes
        choice = resolve_backend(self.config.backend, device, layer_shapes(nodes), ctx.dist.agree)
        op = choice.backend.op
        meta = metadata_inputs(gm, device)
        specs: List[CacheSpec] = []
        for layer, node in enumerate(nodes):
            specs.extend(rewrite_attention(gm, node, layer, op, meta, device))
        gm.graph.lint()
        gm.recompile()
        details = {
            "backend": choice.name,
            "chosen": choice.why,
            "layers": len(nodes),
            "kv_heads": sorted({s.shape[0] for s in specs}),
            "head_dim": sorted({s.shape[1] for s in specs}),
            "new_inputs": ["seq_lens", "input_pos", "page_table", "num_prefill"] + [s.name for s in specs],
        }
        if classified:
            details["masks_classified_after_load"] = classified
        ctx.cache.declare(specs, ctx.dtype, ctx.limits.page_size)
        ctx.cache.attention = choice
        return gm, TransformInfo(num_matches=len(nodes), is_clean=True, has_valid_shapes=True, details=details)


__all__ = ["InsertCachedAttention", "rewrite_attention", "uncached_attention"]
