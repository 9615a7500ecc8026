"""Per-sequence state slots in the runtime: SLOT cache specs, the slot allocator, the scheduler's slot
per sequence, and the slot_idx step input (the stateful cached ops themselves are tested per op)."""

from __future__ import annotations

import pytest
import torch

from workbench.runtime.kv_cache import (
    PAGED, SLOT, CacheFullError, CacheSpec, KVCacheConfig, SlotAllocator, allocate_caches,
)
from workbench.runtime.scheduler import Request, Scheduler
from workbench.runtime.sequence_info import SLOT_INPUT, SequenceInfo


def _cfg(specs, **kw) -> KVCacheConfig:
    base = dict(page_size=4, num_pages=9, dtype=torch.float32, max_batch_size=2, max_seq_len=16, max_num_tokens=16)
    return KVCacheConfig.sized(**{**base, **kw}, specs=tuple(specs))


def test_slot_spec_geometry_and_bytes():
    conv = CacheSpec("conv_state_0", SLOT, (24, 3))  # [channels, k-1], the cache dtype (fp32)
    ssm = CacheSpec("ssm_state_1", SLOT, (4, 16, 8), torch.float32)
    k = CacheSpec("k_cache_0", PAGED, (2, 16))
    cfg = _cfg([conv, ssm, k], dtype=torch.bfloat16)
    assert cfg.num_slots == 3 and cfg.scratch_slot == 2  # max_batch_size + the scratch row
    assert conv.tensor_shape(cfg) == (3, 24, 3) and ssm.tensor_shape(cfg) == (3, 4, 16, 8)
    per_seq = 24 * 3 * 2 + 4 * 16 * 8 * 4  # conv in bf16 (the cache dtype), ssm pinned to fp32
    assert cfg.state_bytes_per_seq() == per_seq and cfg.slot_bytes() == 3 * per_seq
    assert cfg.bytes_per_page() == 4 * 2 * 16 * 2  # SLOT specs cost nothing per page
    assert cfg.total_bytes() == 9 * cfg.bytes_per_page() + 3 * per_seq
    assert cfg.summary()["state_bytes_per_seq"] == per_seq
    caches = allocate_caches(cfg, torch.device("cpu"))
    assert caches["ssm_state_1"].shape == (3, 4, 16, 8) and caches["ssm_state_1"].dtype == torch.float32
    assert caches["conv_state_0"].dtype == torch.bfloat16 and not caches["conv_state_0"].any()
    assert "state_bytes_per_seq" not in _cfg([k]).summary()  # attention-only pools report as before


def test_unknown_cache_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        CacheSpec("x", "pages", (1,))


def test_slot_allocator_hands_out_lowest_first_and_reuses():
    slots = SlotAllocator(3)
    assert [slots.allocate(s) for s in (10, 11, 12)] == [0, 1, 2]
    assert slots.allocate(11) == 1  # asking again for a holder is idempotent
    with pytest.raises(CacheFullError, match="all 3 are taken"):
        slots.allocate(13)
    slots.free(11)
    assert slots.allocate(13) == 1 and slots.slot(13) == 1
    with pytest.raises(KeyError, match="holds no state slot"):
        slots.slot(11)


def test_scheduler_gives_each_running_sequence_its_own_slot_and_reuses_freed_ones():
    cfg = _cfg([CacheSpec("conv_state_0", SLOT, (8, 3))], num_pages=32)
    sched = Scheduler(cfg)
    reqs = [Request(i, [1, 2, 3], max_new_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    running = [r for r, _ in step.items]
    assert running == reqs[:2]  # max_batch_size=2: the third waits
    assert sorted(sched.slot(r) for r in running) == [0, 1]  # the scratch slot (2) is never handed out
    first_slot = sched.slot(reqs[0])
    sched.finish(reqs[0], "length")
    for r, n in step.items:
        r.num_cached += n
    step = sched.schedule()
    assert reqs[2] in [r for r, _ in step.items] and sched.slot(reqs[2]) == first_slot


def test_sequence_info_feeds_slot_idx():
    info = SequenceInfo(max_batch_size=3, max_num_tokens=8, max_pages_per_seq=2)
    info.set_batch([[1, 2], [3]], [0, 5], [[0], [1, 2]], num_prefill=1, page_size=4, slots=[2, 0])
    assert info.inputs()[SLOT_INPUT].tolist() == [2, 0]
    assert info.inputs()[SLOT_INPUT].dtype == torch.int32
    info.set_batch([[1], [3]], [0, 0], [[0], [1]], num_prefill=2, page_size=4)  # default: slot i
    assert info.inputs()[SLOT_INPUT].tolist() == [0, 1]
    with pytest.raises(ValueError, match="pages and slots describe 2, 2, 2, 1 sequences"):
        info.set_batch([[1], [3]], [0, 0], [[0], [1]], num_prefill=2, page_size=4, slots=[0])
