"""Ops that carry their own tensor-parallel hints, for sharding-aware ("IR") custom models.

A sharding-aware model writes into its exported graph *how* each op splits, instead of leaving the
sharding stage to recognise attention / MLP / MoE regions by structure (``detect_sharding``). The
``apply_sharding_hints`` transform then rewrites each hinted node for this rank alone
(``pipeline/transforms/sharding/hints.py``): node-local and deterministic, no pattern search.

Unsharded semantics are exactly the plain op: at world size 1, or with the transform disabled,
the hints are inert and the graph computes what the HF model computes. The markers
(``torch_hint_all_reduce`` / ``torch_hint_all_gather``) are identities until the transform turns them
into ``torch_dist_all_reduce`` / ``torch_dist_all_gather``.

Hints (string / int arguments, so they survive ``torch.export`` as node arguments):
    ``tp_mode``      ``colwise`` (keep output features ``[n0, n1)``: weight rows, bias rows),
                     ``rowwise`` (keep input features: weight columns; bias on rank 0 only),
                     ``none`` (replicated: routers, latent projections, dim-1 gates).
    ``layer_type``   which region the node belongs to (``LAYER_TYPES``); ``apply_sharding_hints``'s
                     ``shard_layers`` keeps only the listed types sharded.
    ``tp_min_local_shape``  the smallest unit a colwise split may cut (a head: ``head_dim``), so GQA
                     K/V keep whole heads.
    ``output_sizes`` a fused colwise projection's parts (``[I, I]`` for gate|up): each part is split
                     on its own, so every rank keeps its slice of each part (None: one part).

Shapes:
    ``torch_hint_linear(x [..., K], w [N, K], b [N]?)`` -> ``[..., N]``
    ``torch_hint_split_with_sizes(x, sizes, dim, shardable)`` -> pieces of ``x`` along ``dim``;
        with ``shardable`` every size is divided by the world size after sharding (the pieces of a
        fused colwise projection).
    ``torch_hint_view(x, shape, tp_scaled_dim)`` -> ``x.reshape(shape)``; ``shape[tp_scaled_dim]``
        (a head count) is divided by the world size after sharding (-1: nothing scales).
    ``torch_hint_all_reduce(x)`` / ``torch_hint_all_gather(x, dim)`` -> ``x`` (markers).
    ``torch_hint_moe(x [T, H], ids [T, k], weights [T, k], w13 [E, 2I, H], w2 [E, H, I], act_fn,
        moe_mode)`` -> ``[T, H]``: ``torch_moe_fused``; ``moe_mode`` ``ep`` splits the experts over
        the ranks, ``tp`` each expert's intermediate features, ``none`` keeps it whole.

The split / view / marker ops return fresh tensors (custom ops may not alias their inputs); the
copies live only until ``apply_sharding_hints`` lowers the nodes to aten views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..library import define_op
from ..moe.torch_moe import MOE_HOST_SYNC

#: ``tp_mode`` values a hinted linear accepts.
TP_MODES = ("colwise", "rowwise", "none")
#: ``layer_type`` values (``shard_layers`` picks among them; ``unknown`` is sharded only when
#: ``shard_layers`` is unset).
LAYER_TYPES = ("mha", "mla", "mlp", "moe", "ssm", "delta", "lm_head", "unknown")


def _check_hints(op: str, layer_type: str, tp_mode: str = "none") -> None:
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"{op}: layer_type {layer_type!r} is not one of {LAYER_TYPES}")
    if tp_mode not in TP_MODES:
        raise ValueError(f"{op}: tp_mode {tp_mode!r} is not one of {TP_MODES}")


def _linear(x, weight, bias=None, tp_mode="none", layer_type="unknown", tp_min_local_shape=1, output_sizes=None):
    _check_hints("torch_hint_linear", layer_type, tp_mode)
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias=None, tp_mode="none", layer_type="unknown", tp_min_local_shape=1, output_sizes=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


torch_hint_linear = define_op(
    'torch_hint_linear(Tensor x, Tensor weight, Tensor? bias=None, str tp_mode="none", '
    'str layer_type="unknown", int tp_min_local_shape=1, int[]? output_sizes=None) -> Tensor',
    _linear,
    _linear_fake,
    category="matmul",
)


def _split(x, split_sizes, dim=-1, shardable=False, layer_type="unknown"):
    _check_hints("torch_hint_split_with_sizes", layer_type)
    return [t.clone() for t in torch.split_with_sizes(x, list(split_sizes), dim)]


def _split_fake(x, split_sizes, dim=-1, shardable=False, layer_type="unknown"):
    return [t.new_empty(t.shape) for t in torch.split_with_sizes(x, list(split_sizes), dim)]


torch_hint_split_with_sizes = define_op(
    "torch_hint_split_with_sizes(Tensor x, SymInt[] split_sizes, int dim=-1, bool shardable=False, "
    'str layer_type="unknown") -> Tensor[]',
    _split,
    _split_fake,
    category="other",
)


def _view(x, shape, tp_scaled_dim=-1, layer_type="unknown"):
    _check_hints("torch_hint_view", layer_type)
    return x.reshape(list(shape)).clone()


def _infer(x, shape):
    """``shape`` with its one -1 resolved against ``x.numel()`` (fake tensors: symbolic sizes)."""
    shape = list(shape)
    if -1 in shape:
        known = 1
        for i, s in enumerate(shape):
            if i != shape.index(-1):
                known = known * s
        shape[shape.index(-1)] = x.numel() // known
    return shape


torch_hint_view = define_op(
    'torch_hint_view(Tensor x, SymInt[] shape, int tp_scaled_dim=-1, str layer_type="unknown") -> Tensor',
    _view,
    lambda x, shape, tp_scaled_dim=-1, layer_type="unknown": x.new_empty(_infer(x, shape)),
    category="other",
)


def _marker(x, layer_type="unknown"):
    _check_hints("torch_hint_all_reduce", layer_type)
    return x.clone()


torch_hint_all_reduce = define_op(
    'torch_hint_all_reduce(Tensor x, str layer_type="unknown") -> Tensor',
    _marker,
    lambda x, layer_type="unknown": torch.empty_like(x),
    category="other",
)


def _gather_marker(x, dim=-1, layer_type="unknown"):
    _check_hints("torch_hint_all_gather", layer_type)
    return x.clone()


torch_hint_all_gather = define_op(
    'torch_hint_all_gather(Tensor x, int dim=-1, str layer_type="unknown") -> Tensor',
    _gather_marker,
    lambda x, dim=-1, layer_type="unknown": torch.empty_like(x),
    category="other",
)

MOE_MODES = ("ep", "tp", "none")


def _moe(
    x, selected_experts, routing_weights, w1_w3_stacked, w2_stacked, act_fn="silu", moe_mode="ep", layer_type="moe"
):
    _check_hints("torch_hint_moe", layer_type)
    if moe_mode not in MOE_MODES:
        raise ValueError(f"torch_hint_moe: moe_mode {moe_mode!r} is not one of {MOE_MODES}")
    return torch.ops.workbench.torch_moe_fused(
        x, selected_experts, routing_weights, w1_w3_stacked, w2_stacked, act_fn=act_fn
    )


torch_hint_moe = define_op(
    "torch_hint_moe(Tensor x, Tensor selected_experts, Tensor routing_weights, Tensor w1_w3_stacked, "
    'Tensor w2_stacked, str act_fn="silu", str moe_mode="ep", str layer_type="moe") -> Tensor',
    _moe,
    lambda x, *args, **kwargs: torch.empty_like(x),
    host_sync=MOE_HOST_SYNC,
    category="moe",
)

__all__ = [
    "TP_MODES",
    "LAYER_TYPES",
    "MOE_MODES",
    "torch_hint_linear",
    "torch_hint_split_with_sizes",
    "torch_hint_view",
    "torch_hint_all_reduce",
    "torch_hint_all_gather",
    "torch_hint_moe",
]
