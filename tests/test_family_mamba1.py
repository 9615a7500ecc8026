"""The Mamba-1 families end to end: mamba, falcon_mamba, jamba (``tiny:`` archs).

* recognition: ``canonical_mamba1_mixer`` finds every Mamba-1 mixer by layout (also under a class
  name no family has), leaves Mamba-2 mixers alone, and refuses a look-alike in one line;
* the canonical mixer forward (``models/canonical/mamba1.py``: conv op + selective-scan op + the
  module's own projections and norms) equals HF's mixer forward;
* ``export_to_gm`` traces one ``torch_selective_scan`` and one ``torch_causal_conv1d`` per Mamba
  layer (HF's per-token loop cannot export with a dynamic sequence), logits equal to HF eager;
* the whole default pipeline + ``generate`` (selective-scan and conv state slots, KV pages for
  Jamba's attention) equals HF greedy ``generate`` token for token (16 new tokens; HF's hold >= 8
  distinct ids), and a sequence that reuses a finished sequence's slot starts from a zero state.

Weights: HF's init as loaded (``tiny_families/mamba1.py`` says why no re-draw is needed: the
carried state moves the mixers' outputs by 10-90%). Tolerances: fp32 on both sides, summed in
another order (HF's token loop vs the chunked parallel scan): 1e-5 relative for mixer outputs
(observed ~2e-7), 1e-5 of the logits' largest magnitude for logits; tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.build import build_random_model
from workbench.models.canonical.mamba1 import PATCHES, is_mamba1_mixer, mamba1_mixer_forward
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config

ONE_THREAD = True  # see conftest.one_thread
ARCHS = ["mamba", "falcon_mamba", "jamba"]
MIXER_CLASS = {"mamba": "MambaMixer", "falcon_mamba": "FalconMambaMixer", "jamba": "JambaMambaMixer"}
NEW = 16
(PATCH,) = PATCHES


def _model(arch: str) -> torch.nn.Module:
    return build_random_model(build_tiny_config(arch), torch.float32, "cpu", seed=1).eval()


def _mixers(model) -> list:
    return [m for m in model.modules() if is_mamba1_mixer(m)]


# ------------------------------------------------------------------------------------ recognition
@pytest.mark.parametrize("arch", ARCHS)
def test_mixers_are_found_by_layout(arch):
    model = _model(arch)
    targets = PATCH.targets(model)
    assert targets and {type(m).__name__ for m in targets} == {MIXER_CLASS[arch]}
    layers = model.config.num_hidden_layers - (1 if arch == "jamba" else 0)  # jamba: one attention layer
    assert len(targets) == layers


def test_a_mixer_under_another_class_name_is_recognised_and_computed_alike():
    mixer = _mixers(_model("falcon_mamba"))[0]
    mixer.__class__ = type("SomeFutureMixer", (type(mixer),), {})
    assert PATCH.targets(mixer) == [mixer]
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = mixer(x), mamba1_mixer_forward(mixer, x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_mamba2_mixers_are_left_alone_and_a_look_alike_is_refused():
    assert PATCH.targets(_model("mamba2")) == []
    mixer = _mixers(_model("mamba"))[0]
    mixer.x_proj = torch.nn.Linear(128, 30, bias=False)  # rank 4 + 2 * 16 = 36 expected
    with pytest.raises(ValueError) as err:
        is_mamba1_mixer(mixer)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("MambaMixer looks like a Mamba-1 mixer")
    assert "x_proj is not 128 -> dt rank + 2 * state = 4 + 2 * 16" in msg


# ------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("arch", ARCHS)
def test_canonical_mixer_equals_hf_mixer(arch):
    """Each mixer on hidden states of 40 tokens and of 1 token."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in _mixers(_model(arch)):
            for shape in ((2, 40, 64), (1, 1, 64)):
                x = torch.randn(*shape, generator=gen)
                ref, out = m(x), mamba1_mixer_forward(m, x)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                assert err <= 1e-5, (type(m).__name__, shape, err)


def test_canonical_forward_refuses_a_cache_object():
    mixer = _mixers(_model("mamba"))[0]
    for kwargs in (dict(cache=object()), dict(cache_params=object())):
        with pytest.raises(ValueError, match="without cache"):
            mamba1_mixer_forward(mixer, torch.zeros(1, 2, 64), **kwargs)


@pytest.fixture(scope="module")
def families():
    """arch -> (loaded model, Workbench after export_to_gm, export snapshot), one per arch and module:
    the export test reads it, the generation tests run it to the end."""
    cache = {}

    def get(arch):
        if arch not in cache:
            loaded = load_model(f"tiny:{arch}")
            bench = Workbench(loaded, numerics=False)
            cache[arch] = (loaded, bench, bench.step())
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_export_traces_one_scan_per_mamba_layer_and_matches_hf(arch, families):
    loaded, bench, snap = families(arch)
    n = len(_mixers(loaded.model))
    assert snap.key == "export_to_gm" and n >= 2
    hist = snap.op_histogram
    assert hist.get("workbench.torch_selective_scan.default") == n
    assert hist.get("workbench.torch_causal_conv1d.default") == n
    assert hist.get("aten.scaled_dot_product_attention.default", 0) == (1 if arch == "jamba" else 0)
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 40), (3, 5), (1, 1)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), bench.forward(*batch.args)
        assert out.shape == (b, s, loaded.config.vocab_size)
        # fp32 round-off: the scan's sums run in another order than HF's loop, and the CPU's GEMM
        # kernels (AVX2 vs AVX-512) move the last bits of the strided conv output -- up to 1.2e-5 of
        # the logits' range on an AVX2 build; a wrong scan moves them by a good part of it
        assert (out - ref).abs().max().item() <= 3e-5 * max(1.0, ref.abs().max().item())


def _prompts(vocab):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 37)]


def _finished(families, arch):
    loaded, bench, _ = families(arch)
    if not bench.done:
        bench.run()
    n = len(_mixers(loaded.model))
    assert any(s.key == "insert_cached_ssm_attention" and s.info.num_matches == n for s in bench.snapshots)
    return loaded, bench


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_generate_equals_hf_greedy(arch, families):
    """Two prompts of different lengths (5 and 37 tokens) batched together, 16 new tokens each,
    equal HF's greedy ``generate`` of each prompt alone; HF's tokens make a strong oracle."""
    loaded, bench = _finished(families, arch)
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, p, NEW)
        assert len(set(want)) >= 8, want
        assert r.token_ids == want, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_slot_starts_from_zero_state(arch, families):
    """Prompt A, then prompt B alone: B gets A's slot (lowest free first) while A's final state is
    still in it; B's tokens are B's HF tokens. Then the same with every state row poisoned (NaN)."""
    loaded, bench = _finished(families, arch)
    a, b = _prompts(loaded.config.vocab_size)
    want = _hf_greedy(loaded.model, b, NEW)
    bench.generate([a], max_new_tokens=NEW, stop_token_ids=[])
    states = {k: v for k, v in bench.ctx.cache.tensors.items() if k.startswith("ssm_state")}
    assert len(states) == len(_mixers(loaded.model))
    assert all(t[0].abs().sum() > 0 for t in states.values())  # A's state in slot 0
    after_a = {k: t[0].clone() for k, t in states.items()}
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want
    assert all(not torch.equal(t[0], after_a[k]) for k, t in states.items())  # B ran in slot 0
    conv = [v for k, v in bench.ctx.cache.tensors.items() if k.startswith("conv_state")]
    for t in [*states.values(), *conv]:
        t.fill_(float("nan"))
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want
