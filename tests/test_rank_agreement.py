"""Ranks of a sharded run take one choice where each would measure its own (``DistInfo.agree``):
calibration timings differ per rank on a loaded machine, and ranks that chose differently built
different graphs whose collectives parted (a gloo "collective mismatch" abort in the CI run)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.pipeline.context import DistInfo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        info = DistInfo(rank=rank, world_size=2, group_name=dist.group.WORLD.group_name, backend="gloo")
        out.put((rank, info.agree({"choice": f"measured on rank {rank}"})))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_0s_choice():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == {0: {"choice": "measured on rank 0"}, 1: {"choice": "measured on rank 0"}}


def test_one_process_keeps_its_own():
    assert DistInfo().agree("kernel") == "kernel"
    assert torch.distributed.is_initialized() is False
