"""Sharded generation: world size 2 (CPU, gloo, localhost) gives the tokens world size 1 gives.

Per model of the issue: the README prompt and two more, greedy, through the whole default pipeline
on 2 ranks (``Workbench(..., world_size=2)``), against the same model in one process. Also that the
sharded layers' weights on each rank are about half of theirs (the plan's bytes and the graph's
parameters), and that each rank's numerics probe after sharding still matches the eager model.

The tiny models' random weights (init std 0.02) leave greedy tokens decided by the embedding and
LM head alone: with the all-reduce replaced by the identity their tokens still matched, while the
probe's RMSE ratio went to 0.49. So for them the probe (<= 1e-5 after every sharded step) is the
real check; for smollm2 (trained weights) the tokens are: the same mutation changed every token.
"""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.runtime.generate import DEFAULT_PROMPT
from workbench.runtime.generate import text_prompt_ids as prompt_token_ids

TEXTS = [DEFAULT_PROMPT, "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 16
LIMITS = dict(max_batch_size=4, max_seq_len=256)
MODELS = ["tiny:llama", "tiny:qwen3", "tiny:mixtral", "tiny:qwen3_moe", "smollm2"]


def prompts(model: str, vocab: int):
    return TEXTS if model == "smollm2" else [prompt_token_ids(t, vocab) for t in TEXTS]


def tokens(out):
    assert all(r.finish_reason != "error" for r in out.results), [r.error for r in out.results]
    return [r.token_ids for r in out.results]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(model, world-size-1 tokens, the 2-rank ShardedWorkbench after generating, its tokens)."""
    model = request.param
    numerics = model != "smollm2"  # smollm2: 30 layers x 2 ranks of probes would double the test's time
    # Sharded runs keep exact int4 activations (linear_layout.py); the single-process run would take
    # int8 where this CPU measured it faster (AVX2 builds), which parts from exact at near-ties.
    one = Workbench(model, numerics=False, overrides=["linear_weight_layout.int4_activations=fp32"], **LIMITS)
    ps = prompts(model, one.ctx.vocab_size)
    ref = tokens(one.generate(ps, max_new_tokens=NEW_TOKENS))
    del one
    wb = Workbench(model, world_size=2, numerics=numerics, **LIMITS)
    try:
        out = tokens(wb.generate(ps, max_new_tokens=NEW_TOKENS))
        yield model, ref, wb, out
    finally:
        wb.close()


def test_world_size_2_generates_the_world_size_1_tokens(pair):
    model, ref, wb, out = pair
    assert len(ref) == 3 and all(len(t) > 0 for t in ref)
    assert out == ref, f"{model}: 2 ranks {out} != 1 rank {ref}"


def test_every_layer_is_split_and_each_rank_holds_half_of_it(pair):
    model, _, wb, _ = pair
    rows = wb.plan()
    split = {r["region"] for r in rows if r["split"] == "sharded"}
    expected = {"mha", "lm_head"} | ({"moe"} if "moe" in model or "mixtral" in model else {"mlp"})
    assert expected <= split, rows
    whole = sum(r["weight bytes"] for r in rows if r["split"] == "sharded")
    local = sum(r["bytes on rank 0"] for r in rows if r["split"] == "sharded")
    assert 0.45 * whole <= local <= 0.7 * whole  # 9 heads on 2 ranks: rank 0 takes 6 (smollm2)
    snap = wb.snapshot("sharding_transform_executor")
    for rank, s in enumerate(snap.ranks):
        assert s.info.num_matches == len([r for r in rows if r["split"] == "sharded"])
        assert s.info.details["sharded_weight_bytes_this_rank"] < 0.7 * s.info.details["sharded_weight_bytes"]
    mem = wb.memory()
    assert len(mem) == 2


def test_sharded_numerics_probe_matches_eager(pair):
    model, _, wb, _ = pair
    if model == "smollm2":
        pytest.skip("probes off for smollm2 here (time); tests/test_sharding_plan.py covers its plan")
    for key in ("sharding_transform_executor", "load_weights", "compile_model"):
        for s in wb.snapshot(key).ranks:
            assert s.numerics is not None and s.numerics.ok, (key, s.numerics)
            assert s.numerics.rmse_ratio < 1e-5, (key, s.numerics.rmse_ratio)


def test_render_one_sharded_layer_on_each_rank(pair):
    model, _, wb, _ = pair
    if model != "tiny:llama":
        pytest.skip("one model is enough for the render")
    for rank, heads in ((0, "q heads 0-1"), (1, "q heads 2-3")):
        src = wb.render_layer(rank=rank).source
        assert f"rank {rank} of 2" in src and f"shard: column {heads}" in src and "torch_dist_all_reduce" in src
