"""LFM2 (short-conv layers interleaved with attention) through the workbench, against HF eager.

``tiny:lfm2`` has conv / attention / conv layers. Checked here:
* the canonical ``Lfm2ShortConv`` forward equals HF's module (padding mask included);
* ``export_to_gm`` holds one ``torch_causal_conv1d`` per conv layer (HF's ``nn.Conv1d`` gone) and
  its logits equal HF's; with 4 layers (where layer stamping is tried) stamping refuses the mixed
  stack with its reason and exports it whole;
* after the whole default pipeline every conv is cached over a per-layer ``[64, 2]`` conv state,
  and greedy generation gives exactly HF's tokens (each prompt generated alone by HF) with chunked
  prefill (``max_num_tokens=8`` < the 13-token prompt), decodes mixed with prefills, and a state
  slot reused by a later prompt (4 prompts, 3 slots). Before ``insert_cached_causal_conv`` existed
  the conv layers saw only each step's new token: fluent-looking, wrong tokens.

Tolerances: the canonical forward and the exported graph run the same fp32 ops as HF in the same
order (measured: bit-identical), 1e-5 absolute on logits as in ``test_export``; the pipeline's
numerics probe and decode-vs-reforward use the 1e-5 RMSE ratio of ``test_generate``.
"""

from __future__ import annotations

import pytest
import torch

from test_runtime import _hf_greedy, decode_vs_reforward

from workbench import Workbench
from workbench.models import load_model
from workbench.models.canonical.conv import lfm2_short_conv_forward
from workbench.models.export_contract import CausalLMLogits, make_batch

ONE_THREAD = True  # see conftest.one_thread
CONV = "workbench.torch_causal_conv1d.default"
CACHED_CONV = "workbench.torch_cached_causal_conv1d.default"
NEW = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny:lfm2")


@pytest.fixture(scope="module")
def bench(loaded):
    """The whole default pipeline; limits small enough to force chunked prefill and slot reuse."""
    wb = Workbench(loaded, max_batch_size=3, max_num_tokens=8)
    wb.run()
    return wb


def _snapshot(wb, key):
    return next(s for s in wb.snapshots if s.key == key)


def test_tiny_lfm2_mixes_conv_and_attention_layers(loaded):
    kinds = ["conv" if hasattr(layer, "conv") else "attention" for layer in loaded.model.model.layers]
    assert kinds == ["conv", "attention", "conv"]


@pytest.mark.parametrize("padded", [False, True])
def test_canonical_short_conv_equals_hf_module(loaded, padded):
    layer = loaded.model.model.layers[0].conv
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        mask[1, :4] = 0  # left padding of the second sequence: zeroed before it reaches the conv
    mask = mask if padded else None
    with torch.no_grad():
        ref = layer(x, attention_mask=mask)
        out = lfm2_short_conv_forward(layer, x, attention_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_canonical_short_conv_refuses_an_hf_cache(loaded):
    with pytest.raises(ValueError, match="insert_cached_causal_conv"):
        lfm2_short_conv_forward(loaded.model.model.layers[0].conv, torch.zeros(1, 2, 64), past_key_values=object())


def test_export_has_one_conv_op_per_conv_layer_and_matches_hf(loaded, bench):
    snap = _snapshot(bench, "export_to_gm")
    hist = snap.op_histogram
    assert hist.get(CONV, 0) == 2 and hist.get("aten.scaled_dot_product_attention.default", 0) == 1
    assert not any("conv1d" in k or "convolution" in k for k in hist if k != CONV), hist
    assert "canonical_lfm2_short_conv" in snap.info.details["patches"]
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 16), (3, 5), (1, 1)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), bench.forward(*batch.args, at="export_to_gm")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_layer_stamping_refuses_the_mixed_stack():
    """4 layers (stamping traces 3 and copies the third): conv and attention layers differ, so
    export_to_gm exports every layer and says why; the graph still matches HF."""
    from workbench.models.tiny import TINY_ARCHS
    from workbench.models.tiny_families.conv import ARCHS

    def four_layers():
        config = ARCHS["lfm2"]()
        config.num_hidden_layers, config.layer_types = 4, ["conv", "full_attention", "conv", "full_attention"]
        return config

    loaded = load_model("tiny:lfm2x4", tiny_registry={**TINY_ARCHS, "lfm2x4": four_layers})
    wb = Workbench(loaded, numerics=False)
    snap = wb.step()
    assert snap.info.details["layers"].startswith("full export: layer 2 differs from layer 1"), snap.info.details
    assert snap.op_histogram.get(CONV, 0) == 2
    batch = make_batch(512, 2, 7, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(wb.forward(*batch.args), CausalLMLogits(loaded.model)(*batch.args),
                                   atol=1e-5, rtol=0)


def test_pipeline_caches_every_conv_with_a_state_per_layer(bench):
    snap = _snapshot(bench, "insert_cached_causal_conv")
    assert snap.info.num_matches == 2
    assert snap.info.details["states"] == {"conv_state_0": [64, 2], "conv_state_2": [64, 2]}
    final = bench.snapshots[-1]
    assert final.op_histogram.get(CACHED_CONV, 0) == 2 and final.op_histogram.get(CONV, 0) == 0
    probe = final.numerics
    assert probe is not None and probe.ok and probe.rmse_ratio <= 1e-5


def test_generate_equals_hf_greedy(loaded, bench):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 13, 3, 9)]
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert out.stats.max_concurrency == 3  # the 4th prompt waits for, then reuses, a finished slot
    for p, r in zip(prompts, out.results):
        ref = _hf_greedy(loaded.model, p, NEW)
        assert len(set(ref)) > NEW // 2  # the reference is not one token repeated (it would prove little)
        assert r.token_ids == ref, f"prompt of {len(p)} tokens"


def test_mixed_decode_steps_equal_reforward(bench):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 11, 2)]
    worst, compared, mixed = decode_vs_reforward(bench, prompts, steps=4, join_at=1)
    assert compared == 12 and mixed > 0 and worst <= 1e-5, worst
