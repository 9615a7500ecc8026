"""RecurrentGemma end to end (``tiny:recurrent_gemma``: RG-LRU, RG-LRU, local attention of window 8).

* the canonical recurrent-block forward (``models/canonical/rglru.py``) equals HF's block forward,
  and the block is recognised by its structure (a renamed copy of the class is patched too, a
  near miss is not);
* ``export_to_gm`` traces one ``torch_rglru`` and one ``torch_causal_conv1d`` per recurrent layer
  (HF's loop over time would fail the dynamic-length export), with logits equal to HF eager;
* the carried RG-LRU state matters in this tiny model: tokens 0..19 reach token 39's logits only
  through it (window 8, conv 4), and changing them moves those logits by far more than round-off;
* the whole default pipeline (RG-LRU and conv state slots; paged KV with the sliding window for the
  attention layer; the logits soft-cap kept) + ``generate`` equals HF greedy ``generate`` token for
  token, also for a sequence in a reused (or poisoned) slot.

Tolerances: fp32 on both sides, in another order (HF's baddbmm gates and time loop vs einsum and a
log-depth scan): 1e-5 relative for block outputs, 1e-5 of the logits' largest magnitude for logits;
generated tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.build import build_random_model
from workbench.models.canonical.rglru import PATCHES, is_rglru_block, rglru_block_forward
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config

ONE_THREAD = True  # see conftest.one_thread
NEW = 16


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "RecurrentGemmaRecurrentBlock"]


def test_canonical_block_equals_hf_block():
    """Each recurrent block on 40 tokens (batch 2) and on 1 token: canonical forward == HF's forward."""
    model = build_random_model(build_tiny_config("recurrent_gemma"), torch.float32, "cpu", seed=1).eval()
    blocks = _blocks(model)
    assert len(blocks) == 2
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in blocks:
            for b, s in ((2, 40), (1, 1)):
                x = torch.randn(b, s, 64, generator=gen)
                pos = torch.arange(s).expand(b, s)
                ref, _ = m(x, position_ids=pos, attention_mask=None, use_cache=False)
                out, _ = rglru_block_forward(m, x, position_ids=pos, attention_mask=None, use_cache=False)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                assert err <= 1e-5, (b, s, err)


def test_block_is_recognised_by_structure():
    """A renamed subclass is a target (by structure); a block whose conv is not causal is not."""
    model = build_random_model(build_tiny_config("recurrent_gemma"), torch.float32, "cpu", seed=0)
    block = _blocks(model)[0]
    (patch,) = PATCHES
    block.__class__ = type("SomeoneElsesGriffinBlock", (type(block),), {})
    assert is_rglru_block(block) and block in patch.targets(model)
    block.conv_1d.padding = (1,)  # a centred conv: not the causal conv the op computes
    assert not is_rglru_block(block) and block not in patch.targets(model)
    assert not any(is_rglru_block(m) for m in model.modules() if "Attention" in type(m).__name__)


def test_canonical_forward_refuses_a_cache_object():
    model = build_random_model(build_tiny_config("recurrent_gemma"), torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="without cache"):
        rglru_block_forward(_blocks(model)[0], torch.zeros(1, 2, 64), cache=object())


@pytest.fixture(scope="module")
def family():
    """(loaded model, Workbench after export_to_gm, export snapshot); the generation tests run it on."""
    loaded = load_model("tiny:recurrent_gemma")
    bench = Workbench(loaded, numerics=False)
    return loaded, bench, bench.step()


def test_export_traces_the_canonical_ops_and_matches_hf(family):
    loaded, bench, snap = family
    hist = snap.op_histogram
    assert snap.key == "export_to_gm"
    assert hist.get("workbench.torch_rglru.default") == 2
    assert hist.get("workbench.torch_causal_conv1d.default") == 2
    assert hist.get("aten.scaled_dot_product_attention.default") == 1
    assert hist.get("aten.tanh.default") == 1  # the logits soft-cap
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 40), (3, 5), (1, 1)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), bench.forward(*batch.args)
        assert out.shape == (b, s, loaded.config.vocab_size)
        assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_carried_state_moves_the_logits(family):
    """Tokens 0..19 reach token 39 only through the RG-LRU state (attention window 8, conv 4 taps,
    everything else per token): replacing them changes token 39's logits by > 1e-3 relative."""
    loaded, _, _ = family
    batch = make_batch(loaded.config.vocab_size, 1, 40, seed=5)
    ids, pos = batch.args
    other = ids.clone()
    other[:, :20] = (ids[:, :20] + 1) % loaded.config.vocab_size
    eager = CausalLMLogits(loaded.model)
    with torch.no_grad():
        a, b = eager(ids, pos)[0, -1], eager(other, pos)[0, -1]
    assert ((a - b).abs().max() / a.abs().max()).item() > 1e-3


def _prompts(vocab):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 37)]


def _finished(family):
    loaded, bench, _ = family
    if not bench.done:
        bench.run()
    snaps = {s.key: s for s in bench.snapshots}
    assert snaps["insert_cached_ssm_attention"].info.num_matches == 2
    assert snaps["insert_cached_causal_conv"].info.num_matches == 2
    assert snaps["insert_cached_attention"].info.num_matches == 1
    return loaded, bench


def test_pipeline_generate_equals_hf_greedy(family):
    """Prompts of 5 and 37 tokens batched together, 16 new tokens each, equal HF's greedy
    ``generate`` of each prompt alone (a strong oracle: >= 8 distinct tokens each); the cached
    attention keeps the window and the soft-cap stays in the graph."""
    loaded, bench = _finished(family)
    attention = [n for n in bench.module.graph.nodes if n.op == "call_function" and "cached_attention" in str(n.target)]
    assert len(attention) == 1 and attention[0].kwargs.get("sliding_window") == 8
    assert bench.snapshots[-1].op_histogram.get("aten.tanh.default") == 1
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, p, NEW)
        assert len(set(want)) >= 8
        assert r.token_ids == want, f"prompt of {len(p)} tokens"


def test_reused_slot_starts_from_zero_state(family):
    """Prompt A, then prompt B alone in A's slot (A's final state still there): B's tokens are
    HF's; again with every RG-LRU and conv state row poisoned (NaN)."""
    loaded, bench = _finished(family)
    a, b = _prompts(loaded.config.vocab_size)
    want = _hf_greedy(loaded.model, b, NEW)
    bench.generate([a], max_new_tokens=NEW, stop_token_ids=[])
    states = {k: v for k, v in bench.ctx.cache.tensors.items() if k.startswith("rglru_state")}
    assert len(states) == 2 and all(t[0].abs().sum() > 0 for t in states.values())
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want
    for k, t in bench.ctx.cache.tensors.items():
        if k.startswith(("rglru_state", "conv_state")):
            t.fill_(float("nan"))
    assert bench.generate([b], max_new_tokens=NEW, stop_token_ids=[]).results[0].token_ids == want
