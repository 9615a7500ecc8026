"""Canonical collective ops: what ``sharding_transform_executor`` inserts into a sharded graph.

Each op names its process group by the group's registered name (a string), so the graph holds no
process-group object and stays exportable; the body calls ``torch.distributed``'s functional
collectives (``torch.ops._c10d_functional``: the ops Dynamo and Inductor trace natively), then
waits for the result. Gloo on CPU, NCCL on GPU: whatever backend the group was made with.

Shapes:
    ``torch_dist_all_reduce(x, group_name)``: x [...] -> [...], summed over the ranks (the partial
        results of a row-parallel linear: each rank holds ``x_r @ W_r.T`` for its slice of the
        input features).
    ``torch_dist_all_gather(x, dim, world_size, group_name)``: x [..., n, ...] -> [..., W*n, ...],
        rank r's block at ``[r*n, (r+1)*n)`` along ``dim`` (the vocab-parallel LM head's logits).
"""

from __future__ import annotations

import torch

from ..library import workbench_op


def _require_group(op: str, group_name: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{op} needs a torch.distributed process group ({group_name!r}), and none is initialized in this "
            "process: a sharded graph runs inside the ranks that Workbench(world_size=N), "
            "`workbench run --world-size N` or torchrun start, not in a plain process"
        )


@workbench_op("torch_dist_all_reduce", category="other")
def torch_dist_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group_name``; every rank gets the same result."""
    _require_group("torch_dist_all_reduce", group_name)
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@torch_dist_all_reduce.register_fake
def _all_reduce_fake(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@workbench_op("torch_dist_all_gather", category="other")
def torch_dist_all_gather(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order (equal shapes on every rank)."""
    _require_group("torch_dist_all_gather", group_name)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world_size, group_name)
    out = torch.ops._c10d_functional.wait_tensor(out)  # [W * x.shape[0], ...]: ranks stacked on dim 0
    dim = dim % x.dim()
    if dim == 0:
        return out
    return torch.cat(out.chunk(world_size, dim=0), dim=dim)


@torch_dist_all_gather.register_fake
def _all_gather_fake(x, dim, world_size, group_name):
    shape = list(x.shape)
    shape[dim % x.dim()] = shape[dim % x.dim()] * world_size
    return x.new_empty(shape)


__all__ = ["torch_dist_all_reduce", "torch_dist_all_gather"]
