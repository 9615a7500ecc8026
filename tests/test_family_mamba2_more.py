"""The Mamba-2 mixer recognised by mechanism: granitemoehybrid and zamba2 (``tiny:`` archs) end to end.

* recognition: ``canonical_mamba2_mixer`` finds every mixer of these families (and of a class no
  family has) by structure alone, leaves look-alikes of other mechanisms alone (a gated delta net:
  conv1d + A_log + dt_bias but split projections; a Mamba-1 mixer), and refuses at export, in one
  line naming the class and what is off, a module with the Mamba-2 signature that lacks the rest;
* the canonical forward equals HF's mixer forward on each family's mixers;
* ``export_to_gm`` traces one ``torch_ssm`` and one ``torch_causal_conv1d`` per mixer (none of HF's
  einsums), logits equal to HF eager;
* the whole default pipeline + ``generate`` equals HF greedy ``generate`` token for token (16 new
  tokens; HF's hold >= 8 distinct ids), and the ``workbench check`` row of each family passes.

Weights: every model first gets checkpoint-like mixer weights (``checkpoint_like_ssm_weights``, which
finds mixers by the same structure), so the state carries over dozens of tokens; see
``tests/test_family_ssm.py`` for why and for the tolerances (fp32 round-off: 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.build import build_random_model
from workbench.models.canonical import swap_forwards
from workbench.models.canonical.ssm import PATCHES, is_mamba2_mixer, mamba2_mixer_forward, mamba2_mixers
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config
from workbench.models.tiny_families.ssm import checkpoint_like_ssm_weights
from workbench.onboarding.check import check_entry
from workbench.onboarding.registry import load_registry

ONE_THREAD = True  # see conftest.one_thread
ARCHS = ["granitemoehybrid", "zamba2"]
MIXER_CLASS = {"granitemoehybrid": "GraniteMoeHybridMambaLayer", "zamba2": "Zamba2MambaMixer"}
NEW = 16
MAMBA2_PATCH = next(p for p in PATCHES if p.name == "canonical_mamba2_mixer")


def _model(arch: str) -> torch.nn.Module:
    return checkpoint_like_ssm_weights(build_random_model(build_tiny_config(arch), torch.float32, "cpu", seed=1)).eval()


# ------------------------------------------------------------------------------------ recognition
@pytest.mark.parametrize("arch", ARCHS)
def test_mixers_are_found_by_structure_under_their_own_class_names(arch):
    model = _model(arch)
    targets = MAMBA2_PATCH.targets(model)
    assert targets and targets == mamba2_mixers(model)
    assert {type(m).__name__ for m in targets} == {MIXER_CLASS[arch]}
    assert MAMBA2_PATCH.classes == ()  # no class names: the structure alone


def test_a_mixer_under_a_class_name_no_family_has_is_recognised_and_computed_alike():
    """A Granite mixer re-classed as ``SomeFutureMixer`` (same attributes, new name): still a target,
    and the canonical forward still equals HF's (its forward, inherited)."""
    mixer = mamba2_mixers(_model("granitemoehybrid"))[0]
    mixer.__class__ = type("SomeFutureMixer", (type(mixer),), {})
    assert is_mamba2_mixer(mixer)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = mixer(x), mamba2_mixer_forward(mixer, x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_other_mechanisms_with_a_conv_and_a_decay_are_left_alone():
    """Qwen3-Next's gated delta net has conv1d, A_log and dt_bias but split input projections; a
    Mamba-1 mixer has in_proj, conv1d and A_log but no dt_bias: neither is a target nor refused."""
    from transformers import MambaConfig

    mamba1 = MambaConfig(hidden_size=64, num_hidden_layers=1, vocab_size=512, state_size=8)
    for config in (build_tiny_config("qwen3_next"), mamba1):
        model = build_random_model(config, torch.float32, "cpu", seed=0)
        assert [p.targets(model) for p in PATCHES] == [[], []]


class LookAlikeMixer(torch.nn.Module):
    """The Mamba-2 signature (A_log, dt_bias, conv1d, one in_proj) without D, norm or sizes."""

    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(64, 300)
        self.conv1d = torch.nn.Conv1d(160, 160, 4, groups=160, padding=3)
        self.A_log = torch.nn.Parameter(torch.zeros(8))
        self.dt_bias = torch.nn.Parameter(torch.zeros(8))


def test_a_look_alike_is_refused_naming_its_class_and_what_is_missing():
    with pytest.raises(ValueError) as err:
        is_mamba2_mixer(LookAlikeMixer())
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("LookAlikeMixer looks like a Mamba-2 mixer")
    assert "missing norm, out_proj, D, num_heads" in msg and "canonical_mamba2_mixer: false" in msg


def test_the_canonical_forward_refuses_a_cache_under_either_name():
    """transformers 5.2x passes HF's cache as ``cache`` (``cache_params`` before): both are refused."""
    mixer = mamba2_mixers(_model("zamba2"))[0]
    for kwargs in ({"cache": object()}, {"cache_params": object()}):
        with pytest.raises(ValueError, match="without cache"):
            mamba2_mixer_forward(mixer, torch.zeros(1, 2, 64), **kwargs)


def test_an_inconsistent_mixer_is_refused_at_export():
    """A Granite mixer without ``D`` and with an in_proj 4 channels too wide (HF's Mamba-2 allows an
    extra MLP slice there, which the canonical split does not have): ``export_to_gm`` stops with the
    predicate's line instead of tracing HF's chunked scan."""
    loaded = load_model("tiny:granitemoehybrid")
    mixer = mamba2_mixers(loaded.model)[1]
    del mixer.D
    with pytest.raises(Exception, match=r"GraniteMoeHybridMambaLayer looks like a Mamba-2 mixer .*missing D"):
        Workbench(loaded, numerics=False).step()
    mixer.D = torch.nn.Parameter(torch.ones(8))
    mixer.in_proj = torch.nn.Linear(64, 300, bias=False)
    with pytest.raises(ValueError, match=r"in_proj width 300 != gate \+ conv \+ dt = 128 \+ 160 \+ 8"):
        with swap_forwards(loaded.model, MAMBA2_PATCH):
            pass


# ------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("arch", ARCHS)
def test_canonical_mixer_equals_hf_mixer(arch):
    """Each mixer on hidden states of 40 tokens (3 chunks) and of 1 token."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in mamba2_mixers(_model(arch)):
            for shape in ((2, 40, 64), (1, 1, 64)):
                x = torch.randn(*shape, generator=gen)
                ref, out = m(x), mamba2_mixer_forward(m, x)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                assert err <= 1e-5, (type(m).__name__, shape, err)


@pytest.fixture(scope="module")
def families():
    """arch -> (loaded model with long-memory steps, Workbench after export_to_gm, export snapshot)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            loaded = load_model(f"tiny:{arch}")
            checkpoint_like_ssm_weights(loaded.model)
            bench = Workbench(loaded, numerics=False)
            cache[arch] = (loaded, bench, bench.step())
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_export_traces_one_scan_per_mixer_and_matches_hf(arch, families):
    """The graph holds one scan and one conv per mixer and none of HF's einsums (Granite's MoE routing
    has its own cumsum). Its logits equal HF eager running the canonical mixer forwards to 1e-6, and
    HF's own eager to 1e-4: the two scan orders differ by fp32 round-off (1e-7 per mixer, above),
    which Zamba2's 4 layers at init std 0.3 amplify to ~2e-5 of the largest logit at 40 tokens."""
    loaded, bench, snap = families(arch)
    n = len(mamba2_mixers(loaded.model))
    assert snap.key == "export_to_gm" and n >= 2
    hist = snap.op_histogram
    assert hist.get("workbench.torch_ssm.default") == n
    assert hist.get("workbench.torch_causal_conv1d.default") == n
    assert not any("einsum" in k for k in hist), "HF's chunked scan leaked into the graph"
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 40), (1, 1)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), bench.forward(*batch.args)
            with swap_forwards(loaded.model, MAMBA2_PATCH):
                canonical = eager(*batch.args)
        scale = max(1.0, ref.abs().max().item())
        assert (out - canonical).abs().max().item() <= 1e-6 * scale
        assert (out - ref).abs().max().item() <= 1e-4 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_generate_equals_hf_greedy(arch, families):
    """Prompts of 5 and 37 tokens (one chunk, three) batched together, 16 new tokens each, equal HF's
    greedy ``generate`` of each prompt alone; every mixer got an SSM state slot."""
    loaded, bench, _ = families(arch)
    if not bench.done:
        bench.run()
    n = len(mamba2_mixers(loaded.model))
    assert any(s.key == "insert_cached_ssm_attention" and s.info.num_matches == n for s in bench.snapshots)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (k,), generator=gen).tolist() for k in (5, 37)]
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, p, NEW)
        assert len(set(want)) >= 8, want  # a strong oracle: HF's tokens depend on the context
        assert r.token_ids == want, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("arch", ARCHS)
def test_check_row_passes(arch):
    """The registry's own entry, as ``workbench check --only <arch>`` runs it."""
    (entry,), _ = load_registry().select([arch])
    result = check_entry(entry)
    assert result.passed, (result.stopped_at, result.error, result.failure)
    assert result.tokens_equal and result.oracle_tokens >= 8
