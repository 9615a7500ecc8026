"""The runtime on tiny:llama: batch description, scheduling, decode == re-forward, continuous
batching with joins and chunked prefill, sampling, streaming, and bad input.

The reference everywhere is the eager HF model (full re-forward, or ``generate`` one prompt at a
time), so a result can only match if the cache, the scheduler and the graph are all right.
"""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.runtime import SamplingParams, SequenceInfo, UncachedRunner, runner_for
from workbench.runtime.sampling import filter_logits, sample
from workbench.runtime.scheduler import Request

VOCAB = 512


ONE_THREAD = True  # see conftest.one_thread


@pytest.fixture(scope="module")
def wb(tiny_llama_done):
    return tiny_llama_done


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _rmse_ratio(out, ref):
    return ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


def decode_vs_reforward(bench, prompts, steps, join_at=None):
    """Greedy-decode ``prompts`` through the cached runner (the others join at step ``join_at``)
    and compare every step's logits with an eager forward of the whole sequence so far.
    Returns (worst RMSE ratio, number of compared logits, number of mixed steps)."""
    runner = runner_for(bench.module, bench.ctx)
    sched = runner.scheduler()
    reqs = [Request(index=i, prompt=p, max_new_tokens=steps) for i, p in enumerate(prompts)]
    for r in reqs if join_at is None else reqs[:1]:
        sched.add(r)
    worst, compared, mixed, i = 0.0, 0, 0, 0
    while sched.has_work:
        if i == join_at:
            for r in reqs[1:]:
                sched.add(r)
        step = sched.schedule()
        mixed += 0 < step.num_prefill < len(step.items)
        logits = runner.step(step, sched)
        for row, (req, n) in enumerate(step.items):
            req.num_cached += n
            if req.num_cached < len(req.tokens):
                continue
            with torch.no_grad():
                ids = torch.tensor([req.tokens])
                ref = bench.loaded.model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, -1]
            worst, compared = max(worst, _rmse_ratio(logits[row], ref)), compared + 1
            req.tokens.append(int(logits[row].argmax()))
            if len(req.generated) >= steps:
                sched.finish(req, "length")
        i += 1
    return worst, compared, mixed


# ------------------------------------------------------------------------------ sequence info


def test_sequence_info_buffers_keep_their_addresses():
    info = SequenceInfo(max_batch_size=4, max_num_tokens=16, max_pages_per_seq=3, device="cpu")
    info.set_batch([[1, 2, 3], [4]], [0, 5], [[0], [1, 2]], num_prefill=1, page_size=4)
    first = {k: v.data_ptr() for k, v in info.inputs().items() if isinstance(v, torch.Tensor)}
    assert info.inputs()["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert info.inputs()["position_ids"].tolist() == [[0, 1, 2, 5]]
    assert info.inputs()["page_table"].tolist() == [[0, 0, 0], [1, 2, 0]]
    assert info.last_token_index.tolist() == [2, 3] and info.num_decode == 1
    info.set_batch([[7], [8], [9]], [3, 6, 0], [[0], [1, 2], [3]], num_prefill=1, page_size=4)
    assert {k: v.data_ptr() for k, v in info.inputs().items() if isinstance(v, torch.Tensor)} == first
    assert info.inputs()["seq_lens"].tolist() == [1, 1, 1] and info.inputs()["num_prefill"] == 1


@pytest.mark.parametrize("args, match", [
    (([[1] * 17], [0], [[0, 1, 2, 3, 4]], 1), "max_num_tokens=16"),
    (([[1]] * 5, [0] * 5, [[0]] * 5, 5), "max_batch_size=4"),
    (([[1], [2, 3]], [0, 4], [[0], [1, 2]], 1), r"sequence 1 \(decode\) has 2"),
    (([[1, 2]], [3], [[0]], 1), "needs 2"),
])
def test_sequence_info_rejects_bad_steps(args, match):
    info = SequenceInfo(max_batch_size=4, max_num_tokens=16, max_pages_per_seq=5, device="cpu")
    with pytest.raises(ValueError, match=match):
        info.set_batch(*args, page_size=4)


def test_advance_decode_equals_setting_the_next_step_in_full():
    """A decode step of the same sequences only advances the buffers; the result is what setting that
    step in full gives, padding rows (the last one here) staying at position 0 on their page."""
    def decode_step(info, pos, key):
        info.set_batch([[7], [8], [0]], pos, [[0, 1], [2], [3]], num_prefill=0, page_size=4, layout_key=key)

    fast = SequenceInfo(max_batch_size=4, max_num_tokens=16, max_pages_per_seq=3, device="cpu")
    decode_step(fast, [4, 1, 0], "a")
    fast.advance_decode([17, 18, 0], num_moving=2, layout_key="b")
    full = SequenceInfo(max_batch_size=4, max_num_tokens=16, max_pages_per_seq=3, device="cpu")
    full.set_batch([[17], [18], [0]], [5, 2, 0], [[0, 1], [2], [3]], num_prefill=0, page_size=4)
    for name, value in full.inputs().items():
        got = fast.inputs()[name]
        assert (got.tolist() if isinstance(got, torch.Tensor) else got) == (
            value.tolist() if isinstance(value, torch.Tensor) else value), name
    assert fast.host_step() == full.host_step() and fast.layout_key == "b"
    fast.set_batch([[1, 2]], [0], [[0]], num_prefill=1, page_size=4, layout_key="c")
    with pytest.raises(ValueError, match="continues a decode-only layout"):
        fast.advance_decode([3], num_moving=1, layout_key="d")
    decode_step(fast, [4, 1, 0], None)  # set without a key: nothing to continue
    with pytest.raises(ValueError, match="continues a decode-only layout"):
        fast.advance_decode([1, 2, 0], num_moving=2, layout_key="e")


def test_decode_steps_of_the_same_batch_only_advance_the_buffers(wb):
    from workbench.runtime.generate import generate

    prompts = _prompts([5, 9])
    want = wb.generate(prompts, max_new_tokens=8, stop_token_ids=[]).token_ids
    runner = runner_for(wb.module, wb.ctx)
    before = runner.advanced_steps
    got = generate(runner, prompts, max_new_tokens=8, stop_token_ids=[]).token_ids
    assert got == want
    # one prefill step, then 7 decode steps: the first sets its layout in full, 6 advance it
    assert runner.advanced_steps - before == 6


# ------------------------------------------------------------------------------ numerics


def test_decode_logits_equal_full_reforward(wb):
    worst, compared, mixed = decode_vs_reforward(wb, _prompts([12, 5, 30]), steps=10, join_at=3)
    assert compared == 30 and mixed >= 1
    assert worst <= 1e-5, worst


def test_batched_greedy_equals_hf_generate_one_at_a_time(wb):
    prompts = _prompts([1, 3, 6, 9, 14, 22, 31, 47])
    out = wb.generate(prompts, max_new_tokens=32, stop_token_ids=[])
    assert out.stats.max_concurrency == 8 and out.stats.generated_tokens == 8 * 32
    for p, r in zip(prompts, out.results):
        assert r.finish_reason == "length" and r.token_ids == _hf_greedy(wb.loaded.model, p, 32)


def test_chunked_prefill_and_joins_give_the_same_tokens(wb):
    prompts = _prompts([40, 3, 25, 9, 17])
    expected = wb.generate(prompts, max_new_tokens=12, stop_token_ids=[]).token_ids
    try:
        # 8 tokens per step: every prompt is prefilled in chunks next to running decodes;
        # 2 sequences at a time: the rest join as others finish.
        wb.configure("initialize_cache", max_num_tokens=8, max_batch_size=2)
        wb.run()
        out = wb.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    finally:
        wb.configure("initialize_cache", max_num_tokens=None, max_batch_size=None)
        wb.run()
    assert out.token_ids == expected
    assert out.stats.mixed_steps > 0 and out.stats.max_concurrency == 2


def test_uncached_fallback(tiny_llama, wb, caplog):
    bench = Workbench(tiny_llama, numerics=False, overrides={"insert_cached_attention.enabled": False})
    bench.run()
    assert isinstance(runner_for(bench.module, bench.ctx), UncachedRunner)
    prompts = _prompts([4, 11])
    got = bench.generate(prompts, max_new_tokens=6, stop_token_ids=[]).token_ids
    assert got == wb.generate(prompts, max_new_tokens=6, stop_token_ids=[]).token_ids
    assert "without a KV cache" in caplog.text


# ------------------------------------------------------------------------------ sampling, streaming


def test_sampling():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2) == [1, 2]
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 2) == [1, 2]
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 2, torch.Generator().manual_seed(0)) == [1, 2]
    kept = filter_logits(torch.tensor([1.0, 3.0, 2.0, -1.0]), top_k=2, top_p=None)
    assert torch.isinf(kept).tolist() == [True, False, False, True]
    draws = lambda s: sample(logits.repeat(50, 1), [SamplingParams(2.0)] * 100, torch.Generator().manual_seed(s))  # noqa: E731
    assert draws(1) == draws(1) and draws(1) != draws(2) and len(set(draws(1))) > 1
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_generate_sampling_is_reproducible(wb):
    prompts = _prompts([5, 8])
    a = wb.generate(prompts, max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=3, stop_token_ids=[])
    b = wb.generate(prompts, max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=3, stop_token_ids=[])
    greedy = wb.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    assert a.token_ids == b.token_ids and a.token_ids != greedy.token_ids


def test_streaming_and_stop_tokens(wb):
    prompts = _prompts([6, 2, 9])
    free = wb.generate(prompts, max_new_tokens=10, stop_token_ids=[]).token_ids
    stop = free[1][3]  # make the 4th token of prompt 1 a stop token
    events = []
    out = wb.generate(prompts, max_new_tokens=10, stop_token_ids=[stop], stream=events.append)
    for r, full in zip(out.results, free):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert r.token_ids == full[:cut] and r.finish_reason == ("stop" if stop in full else "length")
        mine = [e for e in events if e.index == r.index]
        assert [e.token_id for e in mine] == r.token_ids and mine[-1].finished and not any(e.finished for e in mine[:-1])
    assert out.results[1].finish_reason == "stop"


# ------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def small(tiny_llama):
    """Room for 4 sequences of 64 tokens, 8 tokens per page."""
    bench = Workbench(tiny_llama, numerics=False, max_batch_size=4, max_seq_len=64,
                      overrides={"initialize_cache.page_size": 8})
    bench.run()
    return bench


def test_bad_prompts_do_not_disturb_the_others(small):
    good = _prompts([10, 5, 30, 3, 12, 7, 22], seed=4)
    alone = [small.generate([p], max_new_tokens=8, stop_token_ids=[]).results[0].token_ids for p in good]
    bad = {"too_long": list(range(1, 81)), "empty": [], "vocab": [3, VOCAB + 5], "negative": [-1]}
    batch = good[:2] + [bad["too_long"], bad["empty"]] + good[2:5] + [bad["vocab"], bad["negative"]] + good[5:]
    out = small.generate(batch, max_new_tokens=8, stop_token_ids=[])
    by_prompt = iter(alone)
    for prompt, r in zip(batch, out.results):
        if any(prompt == b for b in bad.values()):
            assert r.finish_reason == "error" and r.token_ids == [], r
        else:  # 7 good prompts, at most 4 at a time: queued, and unaffected by the bad ones
            assert r.token_ids == next(by_prompt) and r.finish_reason == "length"
    errors = [r.error for r in out.results if r.error]
    assert any("80 tokens leaves no room" in e and "64" in e for e in errors)
    assert any("empty prompt" in e for e in errors) and sum("outside the vocabulary" in e for e in errors) == 2
    assert out.stats.max_concurrency == 4


def test_long_prompts_truncate_or_shorten_as_documented(small):
    near = list(range(1, 61))  # 60 tokens + 8 new > 64 per sequence
    r_near = small.generate([near], max_new_tokens=8, stop_token_ids=[]).results[0]
    assert len(r_near.token_ids) == 4 and r_near.finish_reason == "length" and "reduced from 8 to 4" in r_near.notes[0]
    out = small.generate([near, list(range(1, 81))], max_new_tokens=8, stop_token_ids=[], truncate_prompt=True)
    r_cut, r_long = out.results  # both keep their last 64 - 8 tokens, all 8 new tokens fit
    assert r_cut.prompt_token_ids == list(range(5, 61)) and len(r_cut.token_ids) == 8
    assert r_long.prompt_token_ids == list(range(25, 81)) and "truncated from 80" in r_long.notes[0]
    again = small.generate([list(range(25, 81))], max_new_tokens=8, stop_token_ids=[])
    assert r_long.token_ids == again.results[0].token_ids
    with pytest.raises(ValueError, match="max_new_tokens"):
        small.generate([[1]], max_new_tokens=0)


def test_no_tokenizer_needs_token_ids(small):
    out = small.generate(["hello", [1, 2]], max_new_tokens=2, stop_token_ids=[])
    assert "no tokenizer" in out.results[0].error and len(out.results[1].token_ids) == 2


def test_pages_are_the_limit_when_the_cache_is_small(small):
    prompts = _prompts([30, 25, 28], seed=9)
    expected = small.generate(prompts, max_new_tokens=10, stop_token_ids=[]).token_ids
    try:
        small.configure("resize_kv_cache", cpu_budget_bytes=12 * 8 * 512)  # 12 pages of 8 tokens
        small.run()
        assert small.ctx.cache.config.num_pages == 12
        out = small.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    finally:
        small.configure("resize_kv_cache", cpu_budget_bytes=256 * 2**20)
        small.run()
    # Each request reserves 5 pages: two run together, the third waits for pages, all finish.
    assert out.token_ids == expected and out.stats.max_concurrency == 2


def test_profile_steps_splits_decode_steps_into_host_and_device_parts(wb):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    plain = wb.generate(prompts, max_new_tokens=6, stop_token_ids=[])
    prof = wb.generate(prompts, max_new_tokens=6, stop_token_ids=[], profile_steps=True)
    assert prof.token_ids == plain.token_ids and plain.stats.decode_step_ms is None
    ms = prof.stats.decode_step_ms
    assert set(ms) == {"schedule", "runner_host", "device_wait", "sample", "bookkeeping", "total"}  # CPU: no "gpu"
    assert all(v >= 0 for v in ms.values()) and ms["runner_host"] > 0
    # medians of parts need not add up exactly, but no part exceeds the median whole by much
    assert max(ms["runner_host"], ms["sample"], ms["schedule"]) <= 1.5 * ms["total"]
    assert "decode step (median ms): schedule" in str(prof.stats)
