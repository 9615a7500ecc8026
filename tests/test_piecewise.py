"""Piecewise CUDA graphs (``compile_model.piecewise_enabled``): the split at cached attention, token
buckets, padding and slicing run on CPU with eager pieces and are checked against the plain graph;
capture and replay are checked on a GPU."""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.pipeline.interface import TransformError
from workbench.runtime.compiled_runner import CompiledRunner
from workbench.runtime.piecewise import PiecewiseGraphs, default_token_buckets

GPU = torch.cuda.is_available()
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]  # 15 prompt tokens in all


@pytest.fixture(scope="module")
def wb(tiny_llama):
    bench = Workbench(tiny_llama, numerics=False)
    bench.run()
    return bench


def piecewise_runner(bench, buckets):
    pieces = PiecewiseGraphs(bench.module, buckets, use_cuda_graphs=False)
    cfg = bench.ctx.cache.config
    return CompiledRunner(bench.module, bench.ctx.cache.tensors, cfg, "cpu", piecewise=pieces), pieces


def greedy(bench, new=12):
    return bench.generate(PROMPTS, max_new_tokens=new, stop_token_ids=[]).token_ids


def test_default_buckets_are_powers_of_two_from_64_up_to_max_num_tokens():
    assert default_token_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert default_token_buckets(100) == [64, 100]
    assert default_token_buckets(32) == [32]


def test_split_puts_each_cached_attention_between_two_row_wise_pieces(wb):
    pieces = PiecewiseGraphs(wb.module, [8], use_cuda_graphs=False)
    assert pieces.num_attention == 2 and pieces.num_captured_pieces == 3
    kinds = [type(m).__name__ for n, m in pieces.split.named_children() if n.startswith("submod_")]
    # the last-token gather (gather_logits_before_lm_head) and the LM head after it run eagerly
    assert kinds == ["CapturedPiece", "PaddedAttention", "CapturedPiece", "PaddedAttention", "CapturedPiece",
                     "GraphModule"]
    # parameters are shared with the pipeline's graph, not copied
    ours = {p.data_ptr() for p in wb.module.parameters()}
    assert {p.data_ptr() for p in pieces.split.parameters()} <= ours


def test_padded_steps_generate_the_same_tokens_as_the_plain_graph(wb):
    ref = greedy(wb)
    runner, pieces = piecewise_runner(wb, [4, 16])
    wb.ctx.runner = runner
    try:
        assert greedy(wb) == ref
    finally:
        wb.ctx.runner = None
    # the 15-token prefill ran in the 16 bucket, each 3-sequence decode step in the 4 bucket
    assert pieces.steps == 12


def test_steps_above_the_largest_bucket_run_unsplit(wb):
    ref = greedy(wb, 4)
    runner, pieces = piecewise_runner(wb, [4])  # the 15-token prefill does not fit
    wb.ctx.runner = runner
    try:
        assert greedy(wb, 4) == ref
    finally:
        wb.ctx.runner = None
    assert pieces.steps == 3  # the decode steps only


def test_mixed_step_matches_the_plain_graph_and_padding_never_reaches_the_cache(wb):
    runner, pieces = piecewise_runner(wb, [16])
    info, page = runner.seq_info, runner.cfg.page_size
    # one 7-token prefill and two decode tokens (at positions 3 and 5 of their sequences): 9 -> 16
    args = ([[3, 1, 4, 1, 5, 9, 2], [6], [5]], [0, 3, 5], [[0], [1], [2]])
    before = {k: v.clone() for k, v in runner.caches.items()}
    info.set_batch(*args, num_prefill=1, page_size=page)
    with torch.no_grad():
        ref = wb.module(*runner._inputs())[0].clone()  # [3, V]: the graph gathers each last token
    written = {k: v.clone() for k, v in runner.caches.items()}
    for k, v in runner.caches.items():
        v.copy_(before[k])
    info.set_batch(*args, num_prefill=1, page_size=page)
    got = pieces(runner.padded_inputs(16), 9)
    assert got.shape[:2] == (1, 3) and ref.shape[0] == 3
    assert (got[0] - ref).abs().max() < 1e-5
    for k, v in runner.caches.items():  # the slots the plain graph wrote (to GEMM rounding), nothing else
        slots = lambda cache: (cache != before[k]).flatten(2).any(-1)  # noqa: E731 [pages, page_size]
        assert torch.equal(slots(v), slots(written[k])) and int(slots(v).sum()) == 9, k
        assert (v - written[k]).abs().max() < 1e-5, k


def test_scratch_prefill_check_agrees_with_the_plain_graph(wb):
    runner, _ = piecewise_runner(wb, [8])
    got = runner.scratch_prefill_logits(5)
    assert (got - runner.scratch_prefill_logits(5, fn=wb.module)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="fits one page"):
        runner.scratch_prefill_logits(runner.cfg.page_size + 1)


def test_bad_uses_are_clear_errors(wb, tiny_llama):
    if not GPU:
        with pytest.raises(RuntimeError, match="need CUDA; use_cuda_graphs=False"):
            PiecewiseGraphs(wb.module, [8], use_cuda_graphs=True)
    uncached = Workbench(tiny_llama, numerics=False, overrides={"insert_cached_attention.enabled": False,
                                                                "initialize_cache.enabled": False,
                                                                "resize_kv_cache.enabled": False})
    uncached.run()
    with pytest.raises(ValueError, match="no cached attention in the graph"):
        PiecewiseGraphs(uncached.module, [8], use_cuda_graphs=False)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="piecewise CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_piecewise_cuda_graphs_generate_the_same_tokens_as_torch_simple(backend):
    from workbench.models import load_model

    bench = Workbench(load_model("tiny:llama", device="cuda", dtype="float32"), device="cuda", numerics=False,
                      overrides={"insert_cached_attention.backend": "triton", "initialize_cache.max_batch_size": 8,
                                 "compile_model.backend": "torch-simple"})
    bench.run()
    ref = greedy(bench, 24)
    bench.configure("compile_model", backend=backend, cuda_graph_batch_sizes=[1, 2, 4], piecewise_enabled=True,
                    piecewise_num_tokens=[16, 64])
    bench.run()
    details = bench.snapshots[-1].info.details
    assert details["piecewise_num_tokens"] == [16, 64] and details["piecewise_captured_pieces"] == 3
    assert details["piecewise_check_max_abs_diff"] < 1e-2
    runner = bench.ctx.runner
    assert greedy(bench, 24) == ref
    assert runner.piecewise.steps >= 1 and runner.piecewise.state.eager_pieces == 0 and runner.replays > 0
    bench.configure("compile_model", piecewise_num_tokens=[1 << 20])
    with pytest.raises(TransformError, match="exceed the KV cache's max_num_tokens"):
        bench.run()
