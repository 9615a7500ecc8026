"""The FlashInfer attention path on CPU, through ``fake_flashinfer`` (flashinfer-python 0.6.18.post1's
signatures and rules, attention in plain torch): how the op calls the library, and how the runtime
plans steps for it -- once per step and layer configuration, from the host's own copy of the step
layout (no device read), re-planned before every CUDA-graph replay into the same fixed buffers,
never during capture. The real kernels run in the GPU tests (``test_cached_attention_op.py``,
``test_kvcache.py``)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import fake_flashinfer
from test_cached_attention_op import LENS, SCHEDULE, VARIANTS, run_schedule
from workbench.ops.step_plan import HostStep, planned

# the module, not the op function of the same name that workbench.ops.attention re-exports
fi = importlib.import_module("workbench.ops.attention.flashinfer_cached_attention")
wb = torch.ops.workbench
I32 = dict(dtype=torch.int32)


@pytest.fixture
def stand_in(monkeypatch):
    """``import flashinfer`` gives the stand-in, and the backend reports that it runs on this CPU."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(fi, "is_available", lambda device=None: (True, "CPU stand-in"))
    monkeypatch.setattr(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan_calls_from_device", 0)
    fi._UNMANAGED.__dict__.clear()
    yield fake_flashinfer
    fi._UNMANAGED.__dict__.clear()


@pytest.mark.parametrize("variant", ["plain", "sliding_window", "logit_cap"])
def test_op_matches_the_reference_over_prefill_chunks_and_decode(stand_in, variant):
    err = run_schedule(wb.flashinfer_cached_attention, LENS, SCHEDULE, VARIANTS[variant], page_size=4,
                       dtype=torch.bfloat16, hq=6, hkv=2, d=64)
    assert err < 2e-2, err


def test_host_indices_describe_the_used_pages_only():
    step = HostStep.from_lists([3, 1], [0, 5], [[7, 2, 9], [4, 8, 1]], page_size=4, num_prefill=1)
    qo, kv, idx, last = fi.host_indices(step)
    assert qo.tolist() == [0, 3, 4] and kv.tolist() == [0, 1, 3] and idx.tolist() == [7, 4, 8]
    assert last.tolist() == [3, 2] and {t.dtype for t in (qo, kv, idx, last)} == {torch.int32}


def _step_args(lens, past, pages, hq=6, hkv=2, d=64, page_size=4, num_pages=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v = bf(1, t, hq, d), bf(1, t, hkv, d), bf(1, t, hkv, d)
    kc, vc = bf(num_pages, page_size, hkv, d), bf(num_pages, page_size, hkv, d)
    table = torch.tensor([p + [0] * (4 - len(p)) for p in pages], **I32)
    meta = (torch.tensor(lens, **I32), torch.tensor(past, **I32), table)
    return (q, k, v, kc, vc), meta, HostStep.from_lists(lens, past, pages, page_size, num_prefill=0)


def _reference(tensors, meta):
    return wb.torch_cached_attention(*[x.clone() for x in tensors], *meta, 0, 0.125)


def test_a_runner_plans_once_per_step_for_all_layers_from_host_lists(stand_in):
    planner = fi.FlashInferPlanner(torch.device("cpu"))
    tensors, meta, step = _step_args([1, 1], [5, 2], [[3, 1], [6]])
    with planned({"flashinfer": planner}, step):
        outs = [wb.flashinfer_cached_attention(*[x.clone() for x in tensors], *meta, 0, 0.125) for _ in range(3)]
        window = wb.flashinfer_cached_attention(*[x.clone() for x in tensors], *meta, 0, 0.125, sliding_window=2)
    assert planner.plans == 2  # one per layer configuration (full / windowed), not one per layer
    assert stand_in.BatchPrefillWithPagedKVCacheWrapper.plan_calls_from_device == 0
    ref = _reference(tensors, meta)
    assert all((o.float() - ref.float()).abs().max() < 2e-2 for o in outs)
    assert not torch.equal(window, outs[0])


def test_graph_mode_replans_the_same_fixed_buffers_before_each_replay(stand_in):
    """What a CUDA-graph replay relies on: the wrapper of graph batch 2 keeps its index buffers, and
    begin() re-plans them for a new step without the op being called (a replay calls no op)."""
    planner = fi.FlashInferPlanner(torch.device("cpu"))
    tensors, meta, step = _step_args([1, 1], [5, 2], [[3, 1], [6]])
    with planned({"flashinfer": planner}, step, graph_batch=2):  # warm-up: creates and plans the wrapper
        wb.flashinfer_cached_attention(*[x.clone() for x in tensors], *meta, 0, 0.125)
    (slot, wrapper), = planner._wrappers.items()
    assert slot[0] == 2 and wrapper.use_cuda_graph
    addresses = [b.data_ptr() for b in wrapper.bufs]
    tensors2, meta2, step2 = _step_args([1, 1], [7, 3], [[9, 4], [11]], seed=1)
    plans = planner.plans
    with planned({"flashinfer": planner}, step2, graph_batch=2):  # "replay": planned in begin()
        assert planner.plans == plans + 1
        out = wb.flashinfer_cached_attention(*[x.clone() for x in tensors2], *meta2, 0, 0.125)
        assert planner.plans == plans + 1  # the op found this step's plan
    assert [b.data_ptr() for b in wrapper.bufs] == addresses
    assert wrapper.bufs[2][:3].tolist() == [9, 4, 11]
    assert (out.float() - _reference(tensors2, meta2).float()).abs().max() < 2e-2
    with pytest.raises(ValueError, match="cannot replay the graph of batch size 2"):
        planner.begin(HostStep.from_lists([1], [0], [[1]], 4, 0), graph_batch=2)


def test_planning_is_refused_under_capture(stand_in, monkeypatch):
    tensors, meta, step = _step_args([1, 1], [5, 2], [[3, 1], [6]])
    monkeypatch.setattr(fi, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captured in a CUDA graph outside the workbench runtime"):
        wb.flashinfer_cached_attention(*tensors, *meta, 0, 0.125)
    planner = fi.FlashInferPlanner(torch.device("cpu"))
    with planned({"flashinfer": planner}, step), pytest.raises(RuntimeError, match="first seen during CUDA-graph capture"):
        wb.flashinfer_cached_attention(*tensors, *meta, 0, 0.125)


def test_calls_outside_a_runner_plan_from_the_metadata_once_per_step(stand_in):
    tensors, meta, _ = _step_args([1, 1], [5, 2], [[3, 1], [6]])
    for _ in range(3):
        wb.flashinfer_cached_attention(*[x.clone() for x in tensors], *meta, 0, 0.125)
    planner = fi._UNMANAGED.planners[torch.device("cpu")]
    assert planner.plans == 1


def test_pipeline_with_flashinfer_attention_and_rmsnorm_generates_the_torch_tokens(stand_in, monkeypatch):
    """The whole pipeline with both FlashInfer backends (stand-in) in bf16: same greedy tokens as the
    torch backends; the runner plans once per step, never per layer, and never reads the device."""
    from test_kvcache import _tiny_llama_head_dim
    from workbench import Workbench
    from workbench.models import load_model
    from workbench.runtime.generate import generate
    from workbench.runtime.runner_for import runner_for

    norm = importlib.import_module("workbench.ops.normalization.flashinfer_rmsnorm")
    monkeypatch.setattr(norm, "is_available", lambda device=None: (True, "CPU stand-in"))
    loaded = load_model("tiny:llama", dtype="bfloat16", tiny_registry=_tiny_llama_head_dim(64))
    prompts = [[i + 1, i + 5, i + 9, 7] for i in range(3)]
    torch_backends = {"insert_cached_attention.backend": "torch", "fuse_rmsnorm.backend": "torch"}
    want = Workbench(loaded, numerics=False, overrides=torch_backends).generate(
        prompts, max_new_tokens=8, stop_token_ids=[]).token_ids
    bench = Workbench(loaded, overrides={"insert_cached_attention.backend": "flashinfer",
                                         "fuse_rmsnorm.backend": "flashinfer"})
    bench.run()
    assert bench.snapshot("insert_cached_attention").info.details["backend"] == "flashinfer"
    assert bench.snapshot("fuse_rmsnorm").info.num_matches > 0
    assert bench.snapshot("resize_kv_cache").numerics.rmse_ratio < 2e-2  # the probe: planned from metadata
    runner = runner_for(bench.module, bench.ctx)

    def device_read(*a, **k):
        raise AssertionError("the runner's steps must be planned from the host layout, not the device metadata")

    monkeypatch.setattr(fi, "_unmanaged_planner", device_read)
    out = generate(runner, prompts, vocab_size=bench.ctx.vocab_size, max_new_tokens=8, stop_token_ids=[])
    assert out.token_ids == want
    planner = runner.planners["flashinfer"]
    assert planner.plans == out.stats.steps  # one key (all layers alike), one plan per step
