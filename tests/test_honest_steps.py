"""Honest steps: a numerics probe that cannot run fails its step (never "done"), and no combination of
disabled cache transforms gives a runner that claims a cache the graph does not have -- ``generate``
either refuses with a message, or generates HF's tokens with stats that say how it ran.

The models: tiny random ones, one of them with a layer of the kind the pattern matcher does not know
(like a Mamba-2 or lightning-attention mixer class outside the canonicalized ones): it pads the
sequence to a multiple of 16 (export at 8 tokens keeps the guard, the probe's 16 tokens trip it) and
mixes positions (a running mean), so a cached graph that keeps it as plain ops feeds it each step's
new tokens only.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from workbench.api import Workbench
from workbench.errors import InputError
from workbench.models import load_model
from workbench.onboarding.check import check_prompts, hf_greedy
from workbench.pipeline.interface import TransformError
from workbench.pipeline.numerics import ProbeError

NEW = 12
CACHE_KEYS = ("insert_cached_attention", "initialize_cache", "resize_kv_cache")


class ChunkedMixer(torch.nn.Module):
    """Wraps a layer's MLP: its input padded to a multiple of ``chunk`` positions (as chunked linear
    attention / SSM scans do), plus the running mean over positions -- a sequence mixer without a cache."""

    def __init__(self, inner: torch.nn.Module, chunk: int = 16, mix: bool = True):
        super().__init__()
        self.inner, self.chunk, self.mix = inner, chunk, mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        if self.mix:
            x = x + x.cumsum(1) / torch.arange(1, s + 1, dtype=x.dtype, device=x.device)[:, None]
        pad = (self.chunk - s % self.chunk) % self.chunk
        return self.inner(F.pad(x, (0, 0, 0, pad)))[:, :s]


def with_mixer(mix: bool = True):
    loaded = load_model("tiny:llama")
    layer = loaded.model.model.layers[0]
    layer.mlp = ChunkedMixer(layer.mlp, mix=mix)
    return loaded


# ----------------------------------------------------------------------------------- the probe
def test_a_probe_that_cannot_run_fails_its_step():
    wb = Workbench(with_mixer(mix=False))
    with pytest.raises(TransformError) as err:
        wb.step()  # export_to_gm: the export (at 8 tokens) works, the probe (16 tokens) trips its guard
    assert err.value.key == "export_to_gm" and isinstance(err.value.cause, ProbeError)
    assert "numerics probe could not run" in str(err.value) and "Guard failed" in str(err.value)
    assert wb.status("export_to_gm") == "failed" and not wb.snapshots  # never "done"
    assert wb.last_error is err.value
    with pytest.raises(TransformError, match="numerics probe could not run"):
        wb.run()  # running again meets the same failure; nothing after it runs


def test_a_failed_probe_with_skip_on_error_is_a_failed_skip():
    wb = Workbench(with_mixer(mix=False), overrides={"export_to_gm.skip_on_error": True})
    snap = wb.step()
    assert snap.status == "failed" and "ProbeError" in (snap.info.skip_reason or "")


def test_numerics_off_runs_no_probe():
    wb = Workbench(with_mixer(mix=False), numerics=False)
    assert wb.step().status == "done"


# ----------------------------------------------------------------------------------- the runner
@pytest.fixture(scope="module")
def llama_bench():
    """tiny:llama run up to the cache stage once; each combination below re-runs only what follows
    (toggling a transform drops the snapshots from it on), with HF's greedy tokens for two prompts."""
    loaded = load_model("tiny:llama")
    prompts = check_prompts(loaded.config.vocab_size, (5, 9))
    with torch.no_grad():
        want = [hf_greedy(loaded.model, p, NEW) for p in prompts]
    assert min(len(set(w)) for w in want) >= 8  # a strong oracle: a missing cache changes these tokens
    wb = Workbench(loaded, numerics=False, max_batch_size=2)
    wb.run_to(wb.keys[wb.index("insert_cached_attention") - 1])
    return wb, prompts, want


@pytest.mark.parametrize(
    "disabled", [c for n in (1, 2, 3) for c in itertools.combinations(CACHE_KEYS, n)], ids="+".join
)
def test_disabled_cache_transforms_never_claim_a_cache(llama_bench, disabled):
    """Every combination: HF's tokens with stats saying how generate ran, or a refusal naming why."""
    wb, prompts, want = llama_bench
    for key in CACHE_KEYS:
        wb.enable(key, key not in disabled)
    try:
        out = wb.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    except (TransformError, InputError) as e:
        # initialize_cache off, insert_cached_attention on: the graph takes cache inputs no one allocated
        assert "initialize_cache" in disabled and "insert_cached_attention" not in disabled
        assert "initialize_cache" in str(e)
        return
    assert out.token_ids == want
    cached = "insert_cached_attention" not in disabled
    assert out.stats.cache == ("paged KV cache" if cached else "uncached (full re-forward)")


def test_attention_cache_off_in_a_hybrid_is_refused():
    """LFM2 (conv + attention): the conv state cached, attention not -- before, generate gave wrong
    tokens under "per-sequence state"; now the cache stage refuses, naming the transform."""
    wb = Workbench("tiny:lfm2", numerics=False, max_batch_size=2)
    wb.enable("insert_cached_attention", False)
    with pytest.raises(TransformError, match="attention node.*no KV cache.*Enable insert_cached_attention") as err:
        wb.generate([[5, 6, 7, 8]], max_new_tokens=4, stop_token_ids=[])
    assert err.value.key == "initialize_cache"


def test_a_mixer_without_a_cache_is_refused_by_generate():
    """The unknown mixer stays plain ops in the cached graph: with the probe off (and resize_kv_cache,
    whose measurement forward trips the mixer's guard, off), the cache stage and compile finish, and
    before, generate gave wrong tokens under "paged KV cache". Now the runner's cache check refuses."""
    wb = Workbench(with_mixer(), numerics=False, max_batch_size=2)
    wb.enable("resize_kv_cache", False)
    with pytest.raises(InputError, match="decode step disagrees with its own prefill"):
        wb.generate([[5, 6, 7, 8, 9]], max_new_tokens=4, stop_token_ids=[])
    assert wb.done  # every step ran: the refusal is generate's


def test_the_cache_check_passes_a_working_cache():
    from workbench.runtime.cache_check import cache_check_tolerance, check_cache_carries_past

    wb = Workbench("tiny:lfm2", numerics=False)
    wb.run()
    check_cache_carries_past(wb.module, wb.ctx.cache.config, wb.ctx.device, wb.ctx.vocab_size, wb.ctx.dtype)
    assert cache_check_tolerance(torch.float32) == 1e-3
    assert 0.08 < cache_check_tolerance(torch.float32, torch.bfloat16) < 0.09
    # a graph that rounds activations to int8 blocks (the Q4 model's a8 kernel) drifts by that grid,
    # as far as 0.097 on smollm2 (cache_check.cache_check_tolerance)
    assert 0.17 < cache_check_tolerance(torch.float32, activation_steps=[2.0**-7]) < 0.18
    assert cache_check_tolerance(torch.float32, activation_steps=[0.5]) == 0.71


def test_activation_steps_reads_the_quantized_ops_of_a_graph():
    """The grid of every op that quantizes its activations, found in nested graphs; none elsewhere."""
    from workbench.ops.quant.fp8 import torch_fp8_linear
    from workbench.runtime.cache_check import activation_steps

    graph = torch.fx.Graph()
    x, w, s = (graph.placeholder(n) for n in ("x", "w", "s"))
    graph.output(graph.call_function(torch_fp8_linear.default, (x, w, s, s)))
    inner = torch.fx.GraphModule(torch.nn.Module(), graph)
    outer = torch.nn.Module()
    outer.block = inner
    assert activation_steps(outer) == [0.125]
    plain = Workbench("tiny:llama", numerics=False)
    plain.run()
    assert activation_steps(plain.module) == []
