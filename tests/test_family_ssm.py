"""The Mamba-2 families end to end: mamba2, bamba, falcon_h1, nemotron_h (``tiny:`` archs).

* the canonical mixer forwards (``models/canonical/ssm.py``) equal HF's own mixer forwards;
* ``export_to_gm`` traces one ``torch_ssm`` and one ``torch_causal_conv1d`` per SSM layer, with
  logits equal to HF eager;
* the whole default pipeline + ``generate`` (SSM and conv state slots, KV pages for the hybrids'
  attention) equals HF greedy ``generate`` token for token, and a sequence that reuses a finished
  sequence's slot starts from a zero state.

HF's random init leaves the scan nearly idle in these tiny models (the state's share of a mixer's
output is below fp32 resolution in the hybrids), so every model here first gets checkpoint-like
mixer weights (``checkpoint_like_ssm_weights``: steps 0.01..0.1, default Linear/Conv1d init): the
state then carries over dozens of tokens and moves mixer outputs by several percent, and prompts
span several 16-token chunks.

Tolerances: mixers and logits are fp32 on both sides, computed in a different order (chunked SSD
einsums vs ours), so they agree to fp32 round-off: 1e-5 relative for mixer outputs, 1e-5 of the
logits' largest magnitude for logits (what ``test_export`` uses); generated tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from test_runtime import _hf_greedy
from workbench import Workbench
from workbench.models import load_model
from workbench.models.build import build_random_model
from workbench.models.canonical.ssm import falcon_h1_mixer_forward, mamba2_mixer_forward
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config
from workbench.models.tiny_families.ssm import MIXER_CLASSES, checkpoint_like_ssm_weights
from workbench.pipeline.matcher import named_args

ONE_THREAD = True  # see conftest.one_thread
ARCHS = ["mamba2", "bamba", "falcon_h1", "nemotron_h"]
NEW = 16


def _mixers(model):
    return [m for m in model.modules() if type(m).__name__ in MIXER_CLASSES]


def _canonical(mixer):
    return falcon_h1_mixer_forward if type(mixer).__name__ == "FalconH1Mixer" else mamba2_mixer_forward


def _falcon_variant(**changes):
    config = build_tiny_config("falcon_h1")
    for k, v in changes.items():
        setattr(config, k, v)
    return config


MIXER_CASES = {
    "mamba2": lambda: build_tiny_config("mamba2"),
    "bamba": lambda: build_tiny_config("bamba"),
    "nemotron_h": lambda: build_tiny_config("nemotron_h"),
    "falcon_h1": lambda: build_tiny_config("falcon_h1"),  # gated norm, gate before normalizing
    "falcon_h1_norm_before_gate": lambda: _falcon_variant(mamba_norm_before_gate=True),
    "falcon_h1_no_norm": lambda: _falcon_variant(mamba_rms_norm=False),  # y * silu(gate), no norm
    "nemotron_h_clamped": lambda: build_tiny_config("nemotron_h"),  # with a biting time_step_min, below
}


@pytest.mark.parametrize("case", sorted(MIXER_CASES))
def test_canonical_mixer_equals_hf_mixer(case):
    """Each mixer of the model on hidden states of 40 tokens (3 chunks) and 1 token: the canonical
    forward (conv op + scan op + the module's own norm and projections) equals HF's forward."""
    model = checkpoint_like_ssm_weights(build_random_model(MIXER_CASES[case](), torch.float32, "cpu", seed=1)).eval()
    mixers = _mixers(model)
    assert mixers
    if case == "nemotron_h_clamped":  # a lower limit above some steps: the clamp must be HF's
        for m in mixers:
            m.time_step_limit = (0.03, float("inf"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in mixers:
            for shape in ((2, 40, 64), (1, 1, 64)):
                x = torch.randn(*shape, generator=gen)
                ref, out = m(x), _canonical(m)(m, x)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                assert err <= 1e-5, (type(m).__name__, shape, err)


def test_canonical_forward_refuses_a_cache_object():
    model = build_random_model(build_tiny_config("mamba2"), torch.float32, "cpu", seed=0)
    mixer = _mixers(model)[0]
    with pytest.raises(ValueError, match="without cache"):
        mamba2_mixer_forward(mixer, torch.zeros(1, 2, 64), cache_params=object())


@pytest.fixture(scope="module")
def families():
    """arch -> (loaded model with long-memory steps, Workbench after export_to_gm, export snapshot).
    One per arch and module: the export test reads it, the generation tests run it to the end."""
    cache = {}

    def get(arch):
        if arch not in cache:
            loaded = load_model(f"tiny:{arch}")
            checkpoint_like_ssm_weights(loaded.model)
            bench = Workbench(loaded, numerics=False)
            cache[arch] = (loaded, bench, bench.step())
        return cache[arch]

    return get


def _ssm_layers(model) -> int:
    return len(_mixers(model))


@pytest.mark.parametrize("arch", ARCHS)
def test_export_traces_one_scan_per_ssm_layer_and_matches_hf(arch, families):
    loaded, bench, snap = families(arch)
    n = _ssm_layers(loaded.model)
    assert snap.key == "export_to_gm" and n >= 2
    hist = snap.op_histogram
    assert hist.get("workbench.torch_ssm.default") == n
    assert hist.get("workbench.torch_causal_conv1d.default") == n
    attention = sum(type(m).__name__.endswith("Attention") for m in loaded.model.modules())
    assert hist.get("aten.scaled_dot_product_attention.default", 0) == attention
    assert not any("einsum" in k or "cumsum" in k for k in hist), "HF's chunked scan leaked into the graph"
    layers = snap.info.details["layers"]
    assert ("stamped" in layers) == (arch == "mamba2"), layers  # only mamba2's layers are all alike
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 40), (3, 5), (1, 1)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), bench.forward(*batch.args)
        assert out.shape == (b, s, loaded.config.vocab_size)
        assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def _prompts(vocab):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 37)]


def _finished(families, arch):
    loaded, bench, _ = families(arch)
    if not bench.done:
        bench.run()
    assert any(s.key == "insert_cached_ssm_attention" and s.info.num_matches == _ssm_layers(loaded.model)
               for s in bench.snapshots)
    return loaded, bench


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_generate_equals_hf_greedy(arch, families):
    """Two prompts of different lengths (5 and 37 tokens: one chunk, three) batched together,
    16 new tokens each, equal HF's greedy ``generate`` of each prompt alone."""
    loaded, bench = _finished(families, arch)
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(loaded.model, p, NEW), f"prompt of {len(p)} tokens"


def _state_tensors(bench, kind):
    return {k: v for k, v in bench.ctx.cache.tensors.items() if k.startswith(kind)}


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_slot_starts_from_zero_state(arch, families):
    """Prompt A, then prompt B alone: B gets A's slot (lowest free first) and A's final state is
    still in it; B's tokens are B's HF tokens. Then the same with every state row poisoned (NaN)."""
    loaded, bench = _finished(families, arch)
    a, b = _prompts(loaded.config.vocab_size)
    want = _hf_greedy(loaded.model, b, NEW)
    bench.generate([a], max_new_tokens=NEW, stop_token_ids=[])
    ssm_states = _state_tensors(bench, "ssm_state")
    assert ssm_states and all(t[0].abs().sum() > 0 for t in ssm_states.values())  # A's state in slot 0
    after_a = {k: t[0].clone() for k, t in ssm_states.items()}
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want
    assert all(not torch.equal(t[0], after_a[k]) for k, t in ssm_states.items())  # B ran in slot 0
    for t in [*ssm_states.values(), *_state_tensors(bench, "conv_state").values()]:
        t.fill_(float("nan"))
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want


def test_conv_activation_is_fused_into_the_cached_conv():
    """Export spells HF's ``silu(conv(x))``; after the cache stage ``fuse_causal_conv_activation``
    folds each SiLU into the cached conv op (CUDA-only by default; ``require_cuda: false`` here):
    one fusion per SSM layer, the conv ops then carry ``activation="silu"``, and HF's tokens."""
    loaded = load_model("tiny:bamba")
    checkpoint_like_ssm_weights(loaded.model)
    bench = Workbench(loaded, numerics=False)
    bench.configure("fuse_causal_conv_activation", require_cuda=False)
    bench.run()
    n = _ssm_layers(loaded.model)
    snap = bench.snapshot("fuse_causal_conv_activation")
    assert snap.info.num_matches == n, snap.info
    convs = [node for node in bench.module.graph.nodes if "cached_causal_conv1d" in str(node.target)]
    assert len(convs) == n and all(dict(named_args(c)).get("activation") == "silu" for c in convs)
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert [r.token_ids for r in out.results] == [_hf_greedy(loaded.model, p, NEW) for p in prompts]
