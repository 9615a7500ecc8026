"""Explaining a token difference from HF (``onboarding/divergence.py``).

* the verdicts from logits: HF's cache changing HF's own answer, workbench's cache, a near-tie, the graph;
* the sparse-attention case (GLM-MoE-DSA's learned top-k indexer): the default pipeline refuses to
  cache its explicit mask; with the attention cache disabled the uncached run equals HF's own uncached
  forward token for token, while HF ``generate`` differs -- the indexer's top-k over ReLU scores has
  ties, which HF's one-row decode breaks another way than a whole-sequence pass. The verdict says so;
* a cached tiny:llama with a token that its own prefill would not give: "workbench's cache".
"""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.models import load_model
from workbench.onboarding.check import CheckResult, explain, hf_greedy
from workbench.onboarding.divergence import classify, explain_divergence, first_difference
from workbench.pipeline.interface import TransformError

ONE_THREAD = True  # see conftest.one_thread


def _logits(*pairs, vocab=8):
    out = torch.zeros(vocab)
    for i, v in pairs:
        out[i] = v
    return out


def test_classify_verdicts():
    hf = _logits((1, 5.0), (2, 4.0))
    # HF's uncached forward picks 1, HF generate said 2: HF's cache changed its answer
    assert classify(ours=1, hf=2, hf_logits=hf, graph_logits=hf)[0] == "hf cache"
    # both forwards pick 1, workbench's cached decode gave 2: its cache
    assert classify(ours=2, hf=1, hf_logits=hf, graph_logits=hf)[0] == "workbench cache"
    # top two 1e-4 apart, the graph's logits 1e-4 from HF's and picking the other one: a near-tie
    close = _logits((1, 5.0), (2, 5.0 - 1e-4))
    graph = _logits((1, 5.0 - 1e-4), (2, 5.0))
    verdict, hf_fwd, g, margin, dist = classify(ours=2, hf=1, hf_logits=close, graph_logits=graph)
    assert (verdict, hf_fwd, g) == ("near-tie", 1, 2) and margin == pytest.approx(1e-4, rel=1e-2)
    # a margin of 1.0 crossed by a graph 3.0 away from HF: the graph computes something else
    far = _logits((1, 2.0), (2, 5.0))
    assert classify(ours=2, hf=1, hf_logits=hf, graph_logits=far)[0] == "graph"


def test_first_difference():
    assert first_difference([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_difference([[1, 2], [4, 5, 6]], [[1, 2], [4, 9, 6]]) == (1, 1)


def _dsa_config():
    """GLM-MoE-DSA at toy size: MLA + a top-4 indexer of 2 heads (fewer keys kept than the prompt has)."""
    from transformers import AutoConfig

    from workbench.models.tiny_families.sizes import MLA_DIMS, MLA_HEADS, MLP_WIDTH, SMALL_TOKEN_IDS, WIDTH

    return AutoConfig.for_model(
        "glm_moe_dsa", **WIDTH, **MLP_WIDTH, **MLA_HEADS, **MLA_DIMS, head_dim=8, q_lora_rank=24,
        num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2,
        indexer_types=["full"] * 2, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, index_topk=4, index_n_heads=2, index_head_dim=16, initializer_range=0.3,
        **SMALL_TOKEN_IDS,
    )


def _hf_uncached_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(ids, use_cache=False).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_sparse_indexer_difference_is_hf_generates_own():
    loaded = load_model("tiny:dsa", tiny_registry={"dsa": _dsa_config}, dtype="float32")
    prompt = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf_greedy(loaded.model, prompt, 16)
        exact = _hf_uncached_greedy(loaded.model, prompt, 16)
    assert want != exact  # HF generate is not HF's own forward here (the premise of this test)

    with pytest.raises(TransformError, match="explicit attn_mask"):
        Workbench(loaded, numerics=False).run()
    wb = Workbench(loaded, numerics=False, overrides={"insert_cached_attention.enabled": False})
    wb.run()
    got = wb.generate([prompt], max_new_tokens=16, stop_token_ids=[]).results[0].token_ids
    assert got == exact  # the uncached re-forward is exact

    found = explain_divergence(wb, loaded.model, [prompt], [got], [want])
    assert found is not None and found.verdict == "hf cache"
    assert (found.ours, found.hf_forward, found.graph) == (got[found.step],) * 3 and found.hf == want[found.step]
    assert "HF's own cache changes its answer" in found.line


def test_cached_token_its_prefill_would_not_give_is_workbenchs_cache():
    loaded = load_model("tiny:llama", dtype="float32")
    wb = Workbench(loaded, numerics=False)
    wb.run()
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        want = hf_greedy(loaded.model, prompt, 6)
    got = list(want)
    got[3] = (want[3] + 1) % 512  # what a cache that lost the past would give instead
    line = explain(wb, loaded.model, [prompt], [got], [want])
    assert line.startswith("workbench's cache does not carry the past (prompt 1, new token 3)"), line
    row = CheckResult(key="llama", model="tiny:llama", tokens_equal=False, tokens="no", divergence=line)
    assert row.failure == f"tokens differ from HF: {line}"
