"""gather_logits_before_lm_head: the LM head runs on each sequence's last new token only."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from workbench import Workbench
from workbench.pipeline.transforms.caches.gather_logits import find_lm_head
from workbench.runtime.sequence_info import SequenceInfo

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


@pytest.fixture(scope="module")
def wb(tiny_llama):
    bench = Workbench(tiny_llama)  # numerics on: the probe still compares every token
    bench.run()
    return bench


def test_the_lm_head_reads_gathered_rows_and_numerics_still_compare_every_token(wb):
    snap = wb.snapshot("gather_logits_before_lm_head")
    assert snap.info.num_matches == 1
    assert snap.numerics is not None and snap.numerics.rmse_ratio < 1e-6
    head = next(n for n in wb.module.graph.nodes if n.name == snap.info.details["lm_head"])
    assert head.args[0].target is torch.ops.aten.index_select.default
    assert head.args[1].op == "get_attr" and "lm_head" in head.args[1].target  # the tied LM head weight


def test_a_prefill_returns_one_row_per_sequence(wb):
    cfg = wb.ctx.cache.config
    info = SequenceInfo.from_config(cfg)
    info.set_batch([list(range(1, 21)), [7, 8, 9]], [0, 0], [[0, 1], [2]], num_prefill=2, page_size=cfg.page_size)
    names = [n.meta.get("wb_cache_input", n.name) for n in wb.module.graph.nodes if n.op == "placeholder"]
    values = {**info.inputs(), **wb.ctx.cache.tensors}
    with torch.no_grad():
        out = wb.module(*[values[n] for n in names])
    assert out.shape == (1, 2, wb.ctx.vocab_size)  # not [1, 23, V]


def test_same_tokens_with_and_without_the_gather(wb):
    ref = wb.generate(PROMPTS, max_new_tokens=10, stop_token_ids=[]).token_ids
    wb.configure("gather_logits_before_lm_head", enabled=False)
    try:
        wb.run()
        assert "last_token_index" not in wb.module.code
        assert wb.generate(PROMPTS, max_new_tokens=10, stop_token_ids=[]).token_ids == ref
    finally:
        wb.configure("gather_logits_before_lm_head", enabled=True)
        wb.run()


def test_without_a_cache_stage_it_says_why_it_skipped(tiny_llama):
    bench = Workbench(tiny_llama, numerics=False, overrides={
        "insert_cached_attention.enabled": False, "initialize_cache.enabled": False,
        "resize_kv_cache.enabled": False})
    bench.run_to("gather_logits_before_lm_head")
    info = bench.snapshot("gather_logits_before_lm_head").info
    assert info.num_matches == 0 and "no cache stage ran" in info.skip_reason


def test_lm_head_is_found_through_row_wise_ops_after_it():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(11, 4))

        def forward(self, x):
            return torch.tanh(torch.nn.functional.linear(x * 2, self.w) / 30.0) * 30.0  # soft-capped logits

    gm = fx.symbolic_trace(Head())
    head = find_lm_head(gm)
    assert head is not None and head.target is torch.nn.functional.linear
    gm2 = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    assert find_lm_head(gm2) is None
