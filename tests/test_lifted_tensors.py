"""Tensors a model makes inside ``forward`` survive the export on ``meta`` and are bound at ``load_weights``.

``torch.export`` lifts a tensor made from Python data inside ``forward`` into the graph as a constant
attribute (``<module>.lifted_tensor_<n>``). Traced on ``meta`` it has no value, and the eager model
holds no tensor of that name, so ``load_weights`` used to fail ("4 graph tensor(s) have no real
weights to load: [...self_attention.lifted_tensor_0, ...]" on Falcon). ``export_to_gm`` now
recovers the values from a trace on CPU and records them; ``load_weights`` binds them.

Two ways a forward makes such tensors, both covered:
* ``torch.tensor(<list>, device=x.device)`` (here: per-channel gains on the attention input);
* indexing with a Python list, ``x[..., [i, j, ...]]``: the index tensor is made in C++ inside
  ``Tensor.__getitem__`` (here: a channel permutation of the attention output; in Falcon's
  multi-query split, ``fused_qkv[..., [-2], :]``), which no Python-level hook sees.
The models: ``tiny:llama`` with every ``self_attn`` wrapped by ``MadeInForward`` (2 and 4 layers: 4
takes export's layer stamping path, which refuses per-layer constants and exports fully), and
``tiny:falcon_mqa`` (the issue's family). Each exports on meta, loads, and generates HF's greedy
tokens through the paged KV cache with every attention layer cached.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from custom_model_support import randomize
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS
from workbench.pipeline.graph.weights import fetch_attr
from workbench.pipeline.transforms.export.forward_constants import constant_values
from workbench.pipeline.weights import FORWARD_CONSTANTS_KEY

NEW = 16
PROMPT_LENS = (5, 11, 3)


class MadeInForward(torch.nn.Module):
    """An attention whose forward makes two tensors from Python data: per-channel input gains
    (``torch.tensor``) and an output channel permutation (a list index)."""

    def __init__(self, inner: torch.nn.Module, hidden: int, seed: int):
        super().__init__()
        self.inner = inner
        rng = random.Random(seed)
        self.gains = [0.5 + rng.random() for _ in range(hidden)]  # Python floats, not a buffer
        self.perm = list(range(hidden))
        rng.shuffle(self.perm)

    def forward(self, hidden_states, **kwargs):
        gains = torch.tensor(self.gains, device=hidden_states.device, dtype=hidden_states.dtype)
        out, weights = self.inner(hidden_states * gains, **kwargs)
        return out[..., self.perm], weights


def load_made_in_forward(layers: int = 2):
    def build():
        config = TINY_ARCHS["llama"]()
        config.num_hidden_layers = layers
        config.tie_word_embeddings = False
        return config

    loaded = load_model("tiny:llama", tiny_registry={**TINY_ARCHS, "llama": build}, dtype="float32")
    randomize(loaded.model, seed=2)  # unit-gain weights: greedy tokens that vary (>= 8 of 16 distinct)
    for i, layer in enumerate(loaded.model.model.layers):
        layer.self_attn = MadeInForward(layer.self_attn, loaded.model.config.hidden_size, seed=i)
    return loaded


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generates_hf_tokens(loaded, bench):
    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches == loaded.model.config.num_hidden_layers and info.skip_reason is None, info
    assert "uncached_attention" not in info.details
    prompts = _prompts(bench.ctx.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for prompt, result in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, prompt, NEW)
        assert len(set(want)) >= 8, want  # greedy tokens that can tell a wrong graph apart
        assert result.token_ids == want, len(prompt)


def test_made_in_forward_exports_on_meta_loads_and_generates_hf_tokens():
    loaded = load_made_in_forward()
    bench = Workbench(loaded)
    bench.run_to("export_to_gm")
    snap = bench.snapshot("export_to_gm")
    made = snap.info.details["forward_constants"]
    assert len(made) == 4 and all("self_attn.lifted_tensor_" in name for name in made), made
    gm = bench.module
    values = gm.meta[FORWARD_CONSTANTS_KEY]
    for name in made:  # meta in the graph until load_weights, the real values recorded beside it
        assert fetch_attr(gm, name).is_meta
    attn = [layer.self_attn for layer in loaded.model.model.layers]
    assert sorted(v.tolist() for v in values.values() if v.is_floating_point()) == sorted(
        torch.tensor(a.gains).tolist() for a in attn
    )
    assert sorted(v.tolist() for v in values.values() if not v.is_floating_point()) == sorted(a.perm for a in attn)
    assert snap.numerics is not None and snap.numerics.error is None and snap.numerics.max_abs == 0.0

    bench.run_to("load_weights")
    details = bench.snapshot("load_weights").info.details
    assert details["bound_constants"] == 4, details
    for name, value in values.items():
        bound = fetch_attr(bench.module, name)
        assert not bound.is_meta and torch.equal(bound.cpu(), value)

    bench.run()
    _generates_hf_tokens(loaded, bench)


def test_made_in_forward_with_layer_stamping_exports_fully():
    """4 layers: export tries to stamp layers 3.. from layer 2; each layer's tensors are its own
    constants (other names), so it refuses and exports the whole model -- every value recorded."""
    loaded = load_made_in_forward(layers=4)
    bench = Workbench(loaded, numerics=False)
    bench.run()
    details = bench.snapshot("export_to_gm").info.details
    assert details["layers"].startswith("full export"), details["layers"]
    assert len(details["forward_constants"]) == 8
    assert bench.snapshot("load_weights").info.details["bound_constants"] == 8
    _generates_hf_tokens(loaded, bench)


def test_falcon_multi_query_split_is_bound_and_generates_hf_tokens():
    """The issue's family: Falcon-7B's multi-query split indexes the fused QKV with ``[-2]`` and
    ``[-1]``; two index tensors per layer, lifted on meta, bound at load."""
    loaded = load_model("tiny:falcon_mqa", dtype="float32")
    bench = Workbench(loaded)
    bench.run()
    made = bench.snapshot("export_to_gm").info.details["forward_constants"]
    assert len(made) == 8 and all(".self_attention.lifted_tensor_" in n for n in made), made
    values = bench.snapshot("export_to_gm").module.meta[FORWARD_CONSTANTS_KEY]
    assert sorted(v.item() for v in values.values()) == [-2] * 4 + [-1] * 4
    assert bench.snapshot("load_weights").info.details["bound_constants"] == 8
    _generates_hf_tokens(loaded, bench)


def test_model_trace_device_needs_no_recovery():
    """Traced where the weights are, the tensors are real already: nothing to recover."""
    loaded = load_made_in_forward()
    bench = Workbench(loaded, numerics=False, overrides={"export_to_gm.trace_device": "model"})
    bench.run_to("load_weights")
    assert bench.snapshot("export_to_gm").info.details["forward_constants"] == {}
    assert bench.snapshot("load_weights").info.details["bound_constants"] == 0


def test_a_cpu_trace_that_differs_is_an_error_naming_the_tensors():
    made = {"m.lifted_tensor_0": torch.empty(2, device="meta"), "m.lifted_tensor_1": torch.empty(3, device="meta")}
    cpu_ep = SimpleNamespace(constants={"m.lifted_tensor_0": torch.ones(2)})
    with pytest.raises(RuntimeError) as err:
        constant_values(made, cpu_ep)
    msg = str(err.value)
    assert "m.lifted_tensor_1 ((3,) torch.float32; on cpu: nothing)" in msg
    assert "trace_device=model" in msg
    cpu_ep.constants["m.lifted_tensor_1"] = torch.ones(3)
    assert set(constant_values(made, cpu_ep)) == set(made)
