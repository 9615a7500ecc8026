"""The delta-rule families end to end: ``tiny:qwen3_next`` (gated delta nets + gated full attention,
MoE), ``tiny:qwen3_5`` / ``qwen3_5_moe`` / ``olmo_hybrid`` (gated delta nets with separate
projections, recognised by structure) and ``tiny:deltanet`` (the ungated rule, our own HF-form model).

* export: each linear-attention layer becomes one ``torch_causal_conv1d`` and one (gated) delta-rule
  op, the logits equal HF eager (the eager model is never patched) at two shapes, one past HF's
  chunk of 64 tokens -- to 5e-5 of the logits' largest magnitude: the same fp32 arithmetic in
  another order (the chunked recurrence's round-off, which the tiny models' init amplifies);
* the whole default pipeline: the cache stage rewrites every delta-rule / conv node into its
  state-slot op (and Qwen3-Next's full-attention layers into cached attention), the cached decode's
  logits equal a full re-forward of HF eager (RMSE ratio <= 1e-5), and greedy tokens equal HF
  ``generate`` token for token -- with 8-token steps, so every prompt is prefilled in chunks next to
  running decodes, and 2 sequences at a time, so the third prompt reuses a finished one's slot.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy, decode_vs_reforward

import workbench.ops.conv  # noqa: F401
import workbench.ops.delta_rule  # noqa: F401
from workbench import Workbench
from workbench.models import load_model
from workbench.models.export_contract import CausalLMLogits, make_batch

ONE_THREAD = True  # see conftest.one_thread

FAMILIES = {
    # arch: (delta-rule op, cached op, linear-attention layers, full-attention layers)
    "qwen3_next": ("torch_gated_delta_rule", "torch_cached_gated_delta_rule", 2, 2),
    # the split-projection spelling, recognised by structure (canonical_split_gated_delta_net)
    "qwen3_5": ("torch_gated_delta_rule", "torch_cached_gated_delta_rule", 1, 1),
    "qwen3_5_moe": ("torch_gated_delta_rule", "torch_cached_gated_delta_rule", 1, 1),
    "olmo_hybrid": ("torch_gated_delta_rule", "torch_cached_gated_delta_rule", 1, 1),
    "deltanet": ("torch_delta_rule", "torch_cached_delta_rule", 4, 0),
}


SHAPES = ((2, 16), (3, 70))  # (batch, seq) for the exported graph; 70 spans two of HF's 64-token chunks


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(arch, loaded model, a Workbench past export_to_gm, the exported graph's logits at SHAPES).
    One export per family serves both tests (it is most of their time); the pipeline test runs the
    rest of the stages. 8 tokens per step: prompts are prefilled in chunks next to running decodes
    (the state ops' chunked-prefill path); 2 sequences at a time: a third prompt reuses a slot."""
    arch = request.param
    # the HF classes through the export-time canonical forwards (models/canonical); qwen3_next's custom
    # canonical-op model (models/custom) has its own tests
    loaded = load_model(f"tiny:{arch}", custom_models=False)
    wb = Workbench(loaded, numerics=False,
                   overrides={"initialize_cache.max_num_tokens": 8, "initialize_cache.max_batch_size": 2})
    wb.step()
    exported = {}
    for b, s in SHAPES:
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():  # the graph is meta-traced: forward() binds the weights by name
            exported[(b, s)] = (batch, wb.forward(*batch.args))
    return arch, loaded, wb, exported


def _count(hist, op):
    return hist.get(f"workbench.{op}.default", 0)


def test_export_routes_each_linear_attention_layer_through_the_ops(family):
    arch, loaded, wb, exported = family
    rule, _, linear, full = FAMILIES[arch]
    snap = wb.snapshots[0]
    assert snap.key == "export_to_gm"
    hist = snap.op_histogram
    assert _count(hist, rule) == linear and _count(hist, "torch_causal_conv1d") == linear
    assert hist.get("aten.scaled_dot_product_attention.default", 0) == full
    layers = snap.info.details["layers"]
    # deltanet's 4 identical layers are stamped from layer 2 (the op nodes included); qwen3_next mixes
    # layer types, so it is exported whole
    assert ("stamped" in layers) == (arch == "deltanet"), layers
    eager = CausalLMLogits(loaded.model)
    for (b, s), (batch, out) in exported.items():
        with torch.no_grad():
            ref = eager(*batch.args)
        assert out.shape == ref.shape == (b, s, loaded.config.vocab_size)
        assert (out - ref).abs().max().item() <= 5e-5 * max(1.0, ref.abs().max().item())


def test_split_spelling_is_recognised_by_structure():
    """The split-projection patch takes the gated delta nets of Qwen3.5, Qwen3.5-MoE and OLMo-Hybrid by
    their attributes (whatever their class is called) and leaves Qwen3-Next's grouped one to its own patch."""
    from workbench.models.canonical.delta_rule import OLMO_HYBRID_SPELLING, QWEN3_5_SPELLING, split_spelling

    want = {"qwen3_5": QWEN3_5_SPELLING, "qwen3_5_moe": QWEN3_5_SPELLING, "olmo_hybrid": OLMO_HYBRID_SPELLING,
            "qwen3_next": None}
    for arch, spelling in want.items():
        model = load_model(f"tiny:{arch}", custom_models=False).model
        mixers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
        assert mixers and {split_spelling(m) for m in mixers} == {spelling}, arch


def test_pipeline_generates_hf_greedy_tokens(family):
    arch, loaded, wb, _ = family
    rule, cached, linear, full = FAMILIES[arch]
    wb.run()
    hist = wb.snapshots[-1].op_histogram
    assert _count(hist, rule) == 0 and _count(hist, cached) == linear
    assert _count(hist, "torch_cached_causal_conv1d") == linear
    infos = {s.key: s.info for s in wb.snapshots}
    # Qwen3-Next's gated, q/k-normed, partial-rotary attention is matched into cached attention
    assert infos["insert_cached_attention"].num_matches == full

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (19, 6, 11)]
    worst, compared, mixed = decode_vs_reforward(wb, prompts[:2], steps=4, join_at=1)
    assert compared == 8 and mixed >= 1 and worst <= 1e-5, worst

    out = wb.generate(prompts, max_new_tokens=16, stop_token_ids=[])
    assert out.stats.mixed_steps > 0 and out.stats.max_concurrency == 2
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(loaded.model, p, 16), f"prompt of {len(p)} tokens"
