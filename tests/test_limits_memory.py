"""Runtime limits that cannot fit in memory fail before anything is allocated, naming the argument.

``max_seq_len=10**9`` used to be accepted and then end in numpy's "Unable to allocate 119. GiB"
inside ``initialize_cache``, with a hint naming the transform. Now ``Workbench(...)`` refuses it at
construction (K/V bytes estimated from the model config), and ``initialize_cache`` checks its real
pool again before allocating (for limits changed after construction, e.g. by ``configure``).
"""

from __future__ import annotations

import time

import pytest
import torch

from workbench import Workbench
from workbench.errors import InputError
from workbench.pipeline.interface import TransformError
from workbench.pipeline.transforms.caches import memory
from workbench.pipeline.transforms.caches.alloc import pool_pages
from workbench.pipeline.transforms.caches.memory import check_fits
from workbench.runtime.interface import PAGED, CacheSpec, KVCacheConfig

ONE_THREAD = True  # see conftest.one_thread


def test_a_huge_max_seq_len_fails_at_construction_naming_it():
    t0 = time.perf_counter()
    with pytest.raises(InputError) as err:
        Workbench("tiny:llama", device="cpu", max_seq_len=10**9)
    msg = str(err.value)
    assert "max_seq_len=1000000000 with max_batch_size=64" in msg
    assert "for the KV cache" in msg and "estimated from the model config" in msg
    assert "GiB is available RAM" in msg
    assert "Lower max_seq_len or max_batch_size" in msg and "max_position_embeddings is 512" in msg
    assert time.perf_counter() - t0 < 60  # model load only: no pipeline ran


def test_a_huge_max_batch_size_names_it():
    with pytest.raises(InputError) as err:
        Workbench("tiny:llama", device="cpu", max_batch_size=10**9)
    assert "with max_batch_size=1000000000" in str(err.value)
    assert "max_batch_size <= " in str(err.value)  # the largest one that fits with this max_seq_len


def test_a_transform_field_is_named_as_the_field():
    with pytest.raises(InputError) as err:
        Workbench("tiny:llama", device="cpu", overrides={"initialize_cache.max_seq_len": 10**9})
    assert "initialize_cache.max_seq_len=1000000000" in str(err.value)


def test_initialize_cache_checks_before_allocating():
    """A limit changed after construction (``configure``) is caught by initialize_cache itself,
    with the real cache tensors' bytes, and nothing is allocated."""
    wb = Workbench("tiny:llama", device="cpu", numerics=False)
    wb.configure("initialize_cache", max_seq_len=10**9)
    with pytest.raises(TransformError) as err:
        wb.run_to("initialize_cache")
    cause = err.value.cause
    assert isinstance(cause, InputError), cause
    assert "initialize_cache.max_seq_len=1000000000 with max_batch_size=64" in str(cause)
    assert "512 B/token" in str(cause)  # 2 layers x K and V x 2 KV heads x head_dim 16 x fp32
    assert "estimated" not in str(cause)
    assert wb.ctx.cache.config is None and not wb.ctx.cache.tensors


def test_the_suggested_limits_are_the_largest_that_fit(monkeypatch):
    cfg = KVCacheConfig.sized(
        page_size=16,
        num_pages=1,
        dtype=torch.float32,
        max_batch_size=8,
        max_seq_len=4096,
        max_num_tokens=256,
        specs=(CacheSpec("k", PAGED, (4, 16)), CacheSpec("v", PAGED, (4, 16))),
    )
    cfg = cfg.with_pages(pool_pages(cfg))
    needed = sum(memory.needed_bytes(cfg))
    monkeypatch.setattr(memory, "available_memory", lambda device: (needed // 2, "test memory"))
    with pytest.raises(InputError) as err:
        check_fits(cfg, torch.device("cpu"), pool_pages)
    msg = str(err.value)
    fit = int(msg.split("max_seq_len <= ")[1].split()[0])

    def need(seq_len: int) -> int:
        c = KVCacheConfig.sized(
            page_size=16,
            num_pages=1,
            dtype=torch.float32,
            max_batch_size=8,
            max_seq_len=seq_len,
            max_num_tokens=256,
            specs=cfg.specs,
        )
        return sum(memory.needed_bytes(c.with_pages(pool_pages(c))))

    assert need(fit) <= needed // 2 < need(fit + 1)
    # what fits passes
    monkeypatch.setattr(memory, "available_memory", lambda device: (needed, "test memory"))
    check_fits(cfg, torch.device("cpu"), pool_pages)
