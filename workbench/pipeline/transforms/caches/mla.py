"""``insert_cached_mla_attention`` (stage ``cache_init``): canonical MLA -> MLA over a paged latent cache.

Every ``torch.ops.workbench.torch_mla`` node (what ``export_to_gm``'s canonical DeepSeek-V2/V3
attention forwards produce) becomes ``torch_cached_mla`` (or ``triton_cached_mla``, same schema)::

    torch_mla(q_nope [b, s, n, dn], q_pe [b, s, n, dr], compressed_kv [b, s, r], kpe [b, s, 1, dr],
              kv_b_proj_weight, scale)
    ->  flatten the per-token inputs to [1, b*s, ...]
        torch_cached_mla(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache_<i>,
                         seq_lens, input_pos, page_table, num_prefill, scale)
        reshape back to [b, s, n, dv]

MLA caches pages like attention (one page table per sequence, shared by every layer), so this is
not a per-sequence-slot state: each layer gets ONE page pool ``[num_pages, page_size, r + dr]``
(the latent after ``kv_a_layernorm``, then the rotated rope key), declared as a ``PAGED``
``CacheSpec`` named ``mla_cache_<i>``; the metadata inputs are ``insert_cached_attention``'s. A
per-head K/V cache of the same layers would hold ``n * (dn + dr + dv)`` values per token; the
snapshot's details report both and the saving.

Backends (``MLA_BACKENDS``): ``torch`` (``torch_cached_mla``, the reference; it reads sequence
lengths on the host, so CUDA graphs cannot capture it) and ``triton`` (``triton_cached_mla``: cache
write and absorbed decode rows in Triton, a decode-only step reads nothing on the host, so CUDA
graphs capture it). ``auto`` (or unset) picks ``triton`` on a CUDA device where Triton runs, else
``torch`` (``pick_mla_backend``). The config is ``insert_cached_attention``'s; another backend
(``cpu``, ``flashinfer``) is refused with what to set instead.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops import mla as _mla_ops  # noqa: F401  (torch_mla / torch_cached_mla, until ops/__init__ imports it)
from ....ops.backends import MLA_BACKENDS
from ....ops.mla.torch_mla import default_scale
from ....runtime.interface import PAGED, CacheSpec
from ...context import CACHE_SPECS, PipelineContext
from ...graph.utils import call_nodes, require_tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes, named_args
from .attention_backend import InsertCachedAttentionConfig
from .inputs import cache_input, metadata_inputs

aten = torch.ops.aten

FIELD = "insert_cached_mla_attention.backend"


def check_mla_backend_name(requested: Optional[str]) -> None:
    """Refuse a backend name MLA has no op for (``cpu``, ``flashinfer``: attention-only backends)."""
    if requested not in (None, "auto", *MLA_BACKENDS.names()):
        ops = ", ".join(b.op_name for b in MLA_BACKENDS)
        raise ValueError(
            f"insert_cached_mla_attention has no {requested!r} backend: MLA runs on "
            f"{' | '.join(repr(n) for n in MLA_BACKENDS.names())} only ({ops}). Set "
            f"{FIELD} to 'auto', 'torch' or 'triton'."
        )


def pick_mla_backend(requested: Optional[str], device: torch.device) -> Tuple[str, str]:
    """(backend, why) for ``insert_cached_mla_attention.backend`` on ``device``: ``auto``/None is
    ``triton`` on CUDA where Triton runs (CUDA graphs can capture it), else the ``torch`` reference
    (``MLA_BACKENDS.choose``); an explicit name must be an MLA backend able to run here."""
    check_mla_backend_name(requested)
    choice = MLA_BACKENDS.choose(requested, torch.device(device), FIELD)
    return choice.name, choice.why


def mla_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return call_nodes(gm, torch.ops.workbench.torch_mla.default)


def mla_shape(node: fx.Node) -> Dict[str, int]:
    """Static MLA dims of one ``torch_mla`` node: heads n, dn, dr, latent rank r, dv."""
    args = dict(named_args(node))
    qn, qp = require_tensor_meta(args["q_nope"]), require_tensor_meta(args["q_pe"])
    lat, w = require_tensor_meta(args["compressed_kv"]), require_tensor_meta(args["kv_b_proj_weight"])
    dims = {"n": qn.shape[2], "dn": qn.shape[3], "dr": qp.shape[3], "r": lat.shape[2]}
    if not all(isinstance(v, int) for v in dims.values()) or not isinstance(w.shape[0], int):
        raise ValueError(f"MLA node {node.name}: head count and head/latent dims must be static, got {dims}")
    dims["dv"] = w.shape[0] // dims["n"] - dims["dn"]
    return dims


def rewrite_mla(
    gm: fx.GraphModule,
    node: fx.Node,
    layer: int,
    meta: Dict[str, fx.Node],
    device: torch.device,
    backend: str = "torch",
) -> CacheSpec:
    """Replace one ``torch_mla`` node by ``backend``'s cached op (``MLA_BACKENDS``, one schema);
    returns the latent page pool it reads."""
    args = dict(named_args(node))
    d = mla_shape(node)
    qn, qp = require_tensor_meta(args["q_nope"]), require_tensor_meta(args["q_pe"])
    scale = default_scale(qn, qp, args["scale"])
    spec = CacheSpec(f"mla_cache_{layer}", PAGED, (d["r"] + d["dr"],), None, layer)
    cache = cache_input(gm, spec, require_tensor_meta(args["compressed_kv"]).dtype, device)

    g = gm.graph
    before = set(g.nodes)
    with g.inserting_before(node):

        def flat(x: fx.Node, *trailing: int) -> fx.Node:  # [b, s, ...] -> [1, b*s, ...]
            return g.call_function(aten.reshape.default, (x, [1, -1, *trailing]))

        out = g.call_function(
            MLA_BACKENDS[backend].op,
            (
                flat(args["q_nope"], d["n"], d["dn"]),
                flat(args["q_pe"], d["n"], d["dr"]),
                flat(args["compressed_kv"], d["r"]),
                flat(args["kpe"], 1, d["dr"]),
                args["kv_b_proj_weight"],
                cache,
                meta["seq_lens"],
                meta["input_pos"],
                meta["page_table"],
                meta["num_prefill"],
                float(scale),
            ),
        )
        b = g.call_function(aten.sym_size.int, (args["q_nope"], 0))
        s = g.call_function(aten.sym_size.int, (args["q_nope"], 1))
        res = g.call_function(aten.reshape.default, (out, [b, s, d["n"], d["dv"]]))
    node.replace_all_uses_with(res)
    annotate_new_nodes(gm, [n for n in g.nodes if n not in before], [node.name], anchor=node)
    g.erase_node(node)
    return spec


def cache_footprint(shapes: List[Dict[str, int]], dtype: torch.dtype) -> Dict[str, object]:
    """Bytes per cached token, all layers together: the latent cache vs a per-head K/V cache."""
    size = dtype.itemsize
    latent = sum((d["r"] + d["dr"]) * size for d in shapes)
    per_head = sum(d["n"] * (d["dn"] + d["dr"] + d["dv"]) * size for d in shapes)
    return {
        "cache_dtype": str(dtype),
        "bytes_per_token": latent,
        "bytes_per_token_per_head_kv": per_head,
        "saving_ratio": round(per_head / latent, 3) if latent else None,
    }


@register("insert_cached_mla_attention")
class InsertCachedMLAAttention(Transform[InsertCachedAttentionConfig]):
    """Rewrite every canonical MLA op into MLA over a paged latent cache (one page pool per layer)."""

    provides = (CACHE_SPECS,)

    def _apply(self, gm: torch.nn.Module, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        if not isinstance(gm, fx.GraphModule):
            raise TypeError("insert_cached_mla_attention rewrites exported graphs, and this model is not exported")
        check_mla_backend_name(self.config.backend)  # refused before looking at the graph
        nodes = mla_nodes(gm)
        if not nodes:
            return gm, TransformInfo(
                num_matches=0,
                skip_reason=(
                    "no torch_mla nodes (the model has no multi-head latent attention, or export_to_gm's "
                    "canonical_deepseek_v*_mla patch was switched off)"
                ),
            )
        shapes = [mla_shape(n) for n in nodes]  # all layers, before the graph changes
        device = ctx.device
        backend, why = pick_mla_backend(self.config.backend, device)
        meta = metadata_inputs(gm, device)
        specs = [rewrite_mla(gm, node, layer, meta, device, backend) for layer, node in enumerate(nodes)]
        gm.graph.lint()
        gm.recompile()
        ctx.cache.declare(specs, ctx.dtype, ctx.limits.page_size)
        details = {
            "backend": backend,
            "chosen": why,
            "layers": len(nodes),
            "kv_lora_rank": sorted({d["r"] for d in shapes}),
            "qk_rope_head_dim": sorted({d["dr"] for d in shapes}),
            **cache_footprint(shapes, ctx.dtype),
            "new_inputs": ["seq_lens", "input_pos", "page_table", "num_prefill"] + [s.name for s in specs],
        }
        return gm, TransformInfo(num_matches=len(nodes), is_clean=True, has_valid_shapes=True, details=details)


__all__ = [
    "InsertCachedMLAAttention",
    "MLA_BACKENDS",
    "pick_mla_backend",
    "check_mla_backend_name",
    "mla_nodes",
    "mla_shape",
    "rewrite_mla",
    "cache_footprint",
]
