"""MiniMax (``tiny:minimax``: lightning attention / full attention / lightning / full, MoE) end to end.

* the canonical lightning-attention forward (``models/canonical/linear_attention.py``) equals HF's
  ``MiniMaxLightningAttention`` forward (its block loop, block size 16) on 40 tokens, 16 and 1;
  the patch finds the layer by structure too (a renamed class), and refuses a cache object;
* the state matters with HF's own init: a token's mixer output with its 20-token past differs from
  the same token alone by far more than fp32 round-off (else a dropped state would pass);
* ``export_to_gm`` traces one ``torch_linear_attention`` per lightning layer (no block loop), with
  logits equal to HF eager at two shapes, one spanning several of HF's blocks;
* the whole default pipeline (``insert_cached_linear_attention``: state slots, KV pages for the
  full-attention layers) then ``generate``: greedy tokens equal HF ``generate`` token for token (16
  new tokens, 3 prompts, 2 sequences at a time with 8-token steps: chunked prefill beside running
  decodes, and a slot reused), the cached decode's logits equal a full re-forward, and HF's tokens
  hold >= 8 distinct ids per prompt (the oracle is strong).

Tolerances: fp32 on both sides in another order (chunks of 64 vs HF's blocks of 16): mixer outputs
to 1e-5 relative, logits to 1e-5 of their largest magnitude, cached decode vs re-forward RMSE ratio
1e-5 (``tiny:minimax`` has init std 0.1 for that: see ``tiny_families/linear_attention.py``);
tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy, decode_vs_reforward

from workbench import Workbench
from workbench.models import load_model
from workbench.models.build import build_random_model
from workbench.models.canonical.linear_attention import PATCHES, is_lightning_attention, lightning_attention_forward
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config

ONE_THREAD = True  # see conftest.one_thread
NEW = 16


def _model(seed=1):
    return build_random_model(build_tiny_config("minimax"), torch.float32, "cpu", seed=seed).eval()


def _lightning(model):
    return [m for m in model.modules() if is_lightning_attention(m)]


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def test_canonical_forward_equals_hf_lightning_attention():
    model = _model()
    layers = _lightning(model)
    assert len(layers) == 2 and len(PATCHES[0].targets(model)) == 2
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in layers:
            for shape in ((2, 40, 64), (1, 16, 64), (1, 1, 64)):
                x = torch.randn(*shape, generator=gen)
                ref, out = m(x, None, None)[0], lightning_attention_forward(m, x, None, None)[0]
                assert _rel(out, ref) <= 1e-5, (shape, _rel(out, ref))


def test_state_moves_the_outputs_with_hf_init():
    """The last token of 21, run with its past vs alone: HF's own mixer outputs differ by > 5%."""
    model = _model()
    x = torch.randn(1, 21, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for m in _lightning(model):
            with_past, alone = m(x, None, None)[0][:, -1], m(x[:, -1:], None, None)[0][:, 0]
            assert _rel(alone, with_past) > 0.05


def test_structure_finds_a_renamed_layer_and_the_forward_refuses_a_cache():
    model = _model()
    layer = _lightning(model)[0]
    renamed = type("ForkedLightningAttention", (torch.nn.Module,), {})()
    renamed.__dict__.update({k: v for k, v in layer.__dict__.items() if k != "training"})
    assert is_lightning_attention(renamed)
    assert not any(is_lightning_attention(m) for m in model.modules() if type(m).__name__ == "MiniMaxAttention")
    with pytest.raises(ValueError, match="without cache"):
        lightning_attention_forward(layer, torch.zeros(1, 2, 64), None, None, cache=object())


@pytest.fixture(scope="module")
def bench():
    """(loaded model, Workbench after export_to_gm). 8 tokens per step and 2 sequences at a time:
    prompts are prefilled in chunks next to running decodes, a third prompt reuses a slot."""
    loaded = load_model("tiny:minimax")
    wb = Workbench(
        loaded, numerics=False, overrides={"initialize_cache.max_num_tokens": 8, "initialize_cache.max_batch_size": 2}
    )
    wb.step()
    return loaded, wb


def test_export_traces_one_op_per_lightning_layer_and_matches_hf(bench):
    loaded, wb = bench
    snap = wb.snapshots[0]
    assert snap.key == "export_to_gm"
    hist = snap.op_histogram
    assert hist.get("workbench.torch_linear_attention.default") == 2
    assert hist.get("aten.scaled_dot_product_attention.default") == 2
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 37), (3, 5)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), wb.forward(*batch.args)
        assert out.shape == (b, s, loaded.config.vocab_size)
        assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_pipeline_generates_hf_greedy_tokens(bench):
    loaded, wb = bench
    wb.run()
    hist = wb.snapshots[-1].op_histogram
    assert hist.get("workbench.torch_linear_attention.default", 0) == 0
    assert hist.get("workbench.torch_cached_linear_attention.default") == 2
    infos = {s.key: s.info for s in wb.snapshots}
    assert infos["insert_cached_linear_attention"].num_matches == 2
    assert infos["insert_cached_linear_attention"].details["states"] == {
        "linear_attention_state_0": [4, 16, 16],
        "linear_attention_state_2": [4, 16, 16],
    }
    assert infos["insert_cached_attention"].num_matches == 2

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (19, 6, 11)]
    worst, compared, mixed = decode_vs_reforward(wb, prompts[:2], steps=4, join_at=1)
    assert compared == 8 and mixed >= 1 and worst <= 1e-5, worst

    out = wb.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert out.stats.mixed_steps > 0 and out.stats.max_concurrency == 2
    for p, r in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, p, NEW)
        assert len(set(want)) >= 8, f"weak oracle: {want}"
        assert r.token_ids == want, f"prompt of {len(p)} tokens"
