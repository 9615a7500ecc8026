"""Attention variants real families use, end to end: canonical op == the HF module it replaces, and
cached generation == HF greedy generation with every attention layer cached.

Variants: logit soft-capping (Gemma 2), sliding-window layers mixed with full ones (Gemma 2/3,
gpt-oss), a window on every layer (Mistral), attention sinks (gpt-oss), a custom softmax scale
(Gemma's query_pre_attn_scalar, Granite's attention_multiplier), QK-norm (OLMo 2 over the whole
projection, Qwen 3 per head), partial rotary (StableLM, GLM), interleaved RoPE pairs (GLM, Cohere),
scaled RoPE frequencies (Llama 3, YaRN).

Weights: the tiny archs' ``initializer_range`` (0.02) makes every attention logit ~0, where a
soft-cap, a window or a sink barely changes anything, so a test could pass with the variant
ignored. Here weights are drawn with std 0.2 (attention logits of order 1-10, peaked softmax), the
soft-cap is lowered to 5 and gpt-oss's sinks are drawn with std 2; each op test also asserts that
dropping the variant's argument moves the result far outside the tolerance.

Tolerances: the canonical op runs the same fp32 math in another order (one matmul for all heads vs
SDPA/eager per head, mask as -inf vs adding finfo.min): fp32 round-off, ``atol = rtol = 2e-5`` on
outputs of order 1-10 (measured: at most 1.5e-6). Generation: identical greedy tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS
from workbench.models.tiny_archs import WINDOW
from workbench.pipeline.matcher import named_args

wb = torch.ops.workbench
TOL = dict(atol=2e-5, rtol=2e-5)
B, S = 2, 11  # S > WINDOW: the window hides keys


def _builder(arch: str, changes: dict):
    base = TINY_ARCHS[arch]

    def build():
        config = base()
        config.initializer_range = 0.2  # peaked attention: see the module docstring
        for key, value in changes.items():
            setattr(config, key, value)
        return config

    return build


def load_variant(arch: str, dtype: str = "float32", **changes):
    """``tiny:<arch>`` with larger weights (and ``changes`` to its config), from a private registry."""
    registry = {**TINY_ARCHS, arch: _builder(arch, changes)}
    loaded = load_model(f"tiny:{arch}", tiny_registry=registry, dtype=dtype)
    for name, p in loaded.model.named_parameters():
        if name.endswith("self_attn.sinks"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 2.0)
    return loaded


# ------------------------------------------------------------------------------ op tests


def hf_mask(s: int, window) -> torch.Tensor:
    """HF's additive eager mask [1, 1, s, s]: 0 where a query may attend, finfo.min elsewhere."""
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = (k <= q) & ((q - k < window) if window is not None else True)
    return torch.zeros(1, 1, s, s).masked_fill(~keep, torch.finfo(torch.float32).min)


# How a family's rotary embedding lays out its cos/sin tables, where that is not the rotate-half
# form [f0, f1, ..., f0, f1, ...] the canonical RoPE ops take.
TABLE_LAYOUT = {"cohere": "interleaved", "gpt_oss": "half_width"}


def rope_tables(cos, sin, layout):
    """cos/sin in rotate-half form: Cohere's are interleaved ([f0, f0, f1, f1, ...]: de-duplicate),
    gpt-oss's are half width ([f0, f1, ...], used for both halves: repeat)."""
    if layout == "interleaved":
        cos, sin = (torch.cat([t[..., 0::2]] * 2, dim=-1) for t in (cos, sin))
    elif layout == "half_width":
        cos, sin = (torch.cat([t] * 2, dim=-1) for t in (cos, sin))
    return cos, sin


def canonical_attention(attn, hidden, cos, sin, *, qk_norm=None, interleaved=False, **variant):
    """``attn`` (an HF ``*Attention``) recomputed from its weights with the canonical ops:
    ``torch_rmsnorm`` (QK-norm), ``torch_rope_with_explicit_cos_sin`` / ``_with_qk_interleaving``
    on the first ``cos.shape[-1]`` dims (partial rotary), ``torch_attention`` (bsnd) with ``variant``
    (scale, sliding_window, logit_cap, sinks). Projections stay plain torch, as in the graph."""
    b, s, _ = hidden.shape
    d = attn.head_dim
    q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
    if qk_norm == "projection":  # OLMo 2: one RMSNorm over all heads, before the split
        q = wb.torch_rmsnorm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
        k = wb.torch_rmsnorm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
    q, k, v = (t.view(b, s, -1, d) for t in (q, k, v))
    if qk_norm == "head":  # Qwen 3: per head, over head_dim
        q = wb.torch_rmsnorm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
        k = wb.torch_rmsnorm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
    rot = cos.shape[-1]
    rope = wb.torch_rope_with_qk_interleaving if interleaved else wb.torch_rope_with_explicit_cos_sin
    q_rot, k_rot = rope(q[..., :rot], k[..., :rot], cos, sin, 2)
    q, k = torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
    out = wb.torch_attention(q, k, v, is_causal=True, layout="bsnd", **variant)
    return attn.o_proj(out.reshape(b, s, -1))


# arch, layer, config changes, canonical_attention kwargs, the variant arguments that must matter
OP_CASES = {
    "softcap_sliding": ("gemma2", 0, {"attn_logit_softcapping": 5.0},
                        dict(scale=24 ** -0.5, logit_cap=5.0, sliding_window=WINDOW), ("logit_cap", "sliding_window")),
    "softcap_full": ("gemma2", 1, {"attn_logit_softcapping": 5.0},
                     dict(scale=24 ** -0.5, logit_cap=5.0), ("logit_cap", "scale")),
    "sinks_sliding": ("gpt_oss", 0, {}, dict(sliding_window=WINDOW, sinks=True), ("sinks", "sliding_window")),
    "sinks_full": ("gpt_oss", 1, {}, dict(sinks=True), ("sinks",)),
    "window_every_layer": ("mistral_sliding", 1, {}, dict(sliding_window=WINDOW), ("sliding_window",)),
    "granite_scale": ("granite", 0, {}, dict(scale=0.1), ("scale",)),
    "qk_norm_projection": ("olmo2", 0, {}, dict(qk_norm="projection"), ("qk_norm",)),
    "qk_norm_head": ("qwen3", 0, {}, dict(qk_norm="head"), ("qk_norm",)),
    "partial_rotary": ("stablelm", 0, {}, dict(), ()),
    "interleaved_partial_rotary": ("glm", 0, {}, dict(interleaved=True), ("interleaved",)),
    "interleaved_rotary": ("cohere", 0, {}, dict(interleaved=True), ("interleaved",)),
    "llama3_frequencies": ("llama3_rope", 0, {}, dict(), ()),
    "yarn_frequencies": ("qwen2_yarn", 0, {}, dict(), ()),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_canonical_ops_equal_hf_attention_module(case):
    arch, layer, changes, kwargs, must_matter = OP_CASES[case]
    model = load_variant(arch, **changes).model
    attn = model.model.layers[layer].self_attn
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, model.config.hidden_size, generator=g)
    positions = torch.arange(S).expand(B, S)
    cos, sin = model.model.rotary_emb(hidden, positions)
    if kwargs.get("sinks"):
        kwargs = {**kwargs, "sinks": attn.sinks}
    with torch.no_grad():
        ref, _ = attn(hidden, position_embeddings=(cos, sin), attention_mask=hf_mask(S, kwargs.get("sliding_window")))
        cos_c, sin_c = rope_tables(cos, sin, TABLE_LAYOUT.get(arch))
        out = canonical_attention(attn, hidden, cos_c, sin_c, **kwargs)
        torch.testing.assert_close(out, ref, **TOL)
        # The inputs exercise the variant: without it the result is far off (so this test can fail).
        for name in must_matter:
            dropped = {**kwargs, name: None if name != "interleaved" else False}
            if name == "scale":
                dropped["scale"] = 1.0 / math.sqrt(attn.head_dim)
            wrong = canonical_attention(attn, hidden, cos_c, sin_c, **dropped)
            assert (wrong - ref).abs().max() > 100 * TOL["atol"], f"{case}: {name} makes no difference here"
    if arch in ("stablelm", "glm"):
        assert cos_c.shape[-1] < attn.head_dim  # partial rotary indeed
    if arch in ("llama3_rope", "qwen2_yarn"):  # the scaled frequencies differ from the default ones
        theta, d = model.config.rope_parameters["rope_theta"], attn.head_dim
        default = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        assert not torch.allclose(model.model.rotary_emb.inv_freq, default)


# ------------------------------------------------------------------------------ cached generation

PROMPT_LENS = (3, 11, 19)  # different lengths, all but one longer than the window; 19 + 16 spans 3 pages
NEW = 16


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


# arch, config changes, per layer the canonical attention arguments the pattern stage must produce
SCALE_GEMMA = 24 ** -0.5
E2E_CASES = {
    "gemma2": ({"attn_logit_softcapping": 5.0},
               [dict(logit_cap=5.0, sliding_window=WINDOW, scale=SCALE_GEMMA), dict(logit_cap=5.0, scale=SCALE_GEMMA)]),
    "gemma3": ({}, [dict(sliding_window=WINDOW, scale=SCALE_GEMMA), dict(scale=SCALE_GEMMA)]),
    "gpt_oss": ({}, [dict(sliding_window=WINDOW, sinks=True), dict(sinks=True)]),
    "mistral_sliding": ({}, [dict(sliding_window=WINDOW)] * 2),
    "granite": ({}, [dict(scale=0.1)] * 2),
    "olmo2": ({}, [{}] * 2),
    "stablelm": ({}, [{}] * 2),
    "glm": ({}, [{}] * 2),
    "cohere": ({}, [{}] * 2),
    "llama3_rope": ({}, [{}] * 2),
    "qwen2_yarn": ({}, [{}] * 2),
}
_DEFAULTS = dict(attn_mask=None, is_causal=True, sliding_window=None, logit_cap=None, sinks=None)


def _canonical_attention_args(bench):
    graph = bench.snapshot("match_attention_layout").graph
    return [dict(named_args(n)) for n in graph.nodes if n.target is wb.torch_attention.default]


@pytest.mark.parametrize("arch,backend", [(a, "auto") for a in sorted(E2E_CASES)]
                         + [("gemma2", "torch"), ("gpt_oss", "torch")])
def test_cached_generation_equals_hf(arch, backend):
    """3 prompts of different lengths in one batch, 16 new tokens each. ``auto``: the C++ kernel
    (``cpu``: decode steps; prefill goes to the reference) where it builds, else the torch
    reference; the soft-cap and sink families also run on the torch reference explicitly."""
    changes, expected = E2E_CASES[arch]
    loaded = load_variant(arch, **changes)
    bench = Workbench(loaded, numerics=False, overrides={"insert_cached_attention.backend": backend})
    bench.run()

    # Every attention layer canonical, with the variant's arguments ...
    args = _canonical_attention_args(bench)
    assert len(args) == len(expected) == loaded.model.config.num_hidden_layers
    for layer, (got, want) in enumerate(zip(args, expected)):
        want = {**_DEFAULTS, **want}
        for key in ("attn_mask", "is_causal", "sliding_window", "logit_cap"):
            assert got[key] == want[key], (arch, layer, key, got[key])
        assert (got["sinks"] is not None) == bool(want["sinks"]), (arch, layer)
        if want["sinks"]:
            assert got["sinks"].op == "get_attr" and got["sinks"].target.endswith(f"layers.{layer}.self_attn.sinks")
        if "scale" in want:
            assert got["scale"] == pytest.approx(want["scale"], rel=1e-12)
    # ... and every one cached, with no attention left to re-run uncached.
    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches == len(expected) and info.skip_reason is None, info
    assert "uncached_attention" not in info.details

    prompts = _prompts(bench.ctx.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert out.stats.max_concurrency == len(prompts)
    for prompt, result in zip(prompts, out.results):
        assert result.token_ids == _hf_greedy(loaded.model, prompt, NEW), (arch, backend, len(prompt))


def test_flashinfer_refuses_sinks_naming_the_backends_that_serve_them(monkeypatch):
    """FlashInfer has no attention sinks: the backend choice refuses gpt-oss before rewriting
    anything, naming the alternatives that run here. A shape FlashInfer otherwise takes (head_dim
    64, bf16), so sinks are the reason; checked without a GPU (FlashInfer's availability faked: the
    check only reads the graph)."""
    import importlib

    from workbench.ops.backends import ATTENTION_BACKENDS
    from workbench.pipeline.transforms.caches.attention_backend import resolve_backend, unsupported_layers
    from workbench.pipeline.transforms.caches.attention import _attention_nodes, layer_shapes

    bench = Workbench(load_variant("gpt_oss", dtype="bfloat16", head_dim=64), numerics=False)
    bench.run_to("match_attention_layout")
    nodes = _attention_nodes(bench.module)
    assert len(nodes) == 2
    fi = importlib.import_module("workbench.ops.attention.flashinfer_cached_attention")
    monkeypatch.setattr(fi, "is_available", lambda device=None: (True, "faked"))
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", torch.device("cpu"), layer_shapes(nodes))
    msg = str(err.value)
    assert "does not support this model: attention sinks (not supported by this backend) (layers [0, 1])" in msg
    assert "Use backend 'torch'" in msg
    for name in ("torch", "cpu", "triton"):  # the backends that do take sinks
        assert unsupported_layers(ATTENTION_BACKENDS.get(name), layer_shapes(nodes)) == {}