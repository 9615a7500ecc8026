"""DeepSeek-V2 MLA end to end: export through ``torch_mla``, ``insert_cached_mla_attention``, generate.

* export: every attention layer of ``tiny:deepseek_v2`` (and the low-rank-query variant) becomes one
  ``torch_mla`` node (no SDPA left) and the graph's logits equal HF eager's at two shapes (1e-5
  absolute on O(1) logits: the graph computes the same fp32 ops, the probe reads 0.0);
* DeepSeek-V3's canonical forward (cos/sin RoPE, interleaved or not) equals HF's attention module;
* the cache stage: one latent page pool per layer of ``kv_lora_rank + qk_rope_head_dim`` values
  per token, the byte counts in the details derived from the config, the numerics probe still at
  fp32 round-off through the cached graph;
* generation: greedy tokens of two prompts of different lengths equal ``transformers.generate`` on
  the same weights, and every decode step's logits (mixed prefill/decode batches included) equal a
  full eager re-forward within 1e-5 RMSE ratio (the absorbed decode form vs HF's expanded one:
  fp32 reassociation only).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.fx as fx

from test_runtime import _hf_greedy, decode_vs_reforward

import workbench.pipeline.transforms.caches.mla  # noqa: F401  (until transforms/__init__ imports it)
from workbench import Workbench
from workbench.models import load_model
from workbench.models.canonical.mla import COS_SIN_ROPE, cos_sin_mla_forward
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.pipeline.transforms.caches.attention_backend import InsertCachedAttentionConfig
from workbench.pipeline.config import load_default_yaml, resolve_pipeline
from workbench.pipeline.interface import TRANSFORMS
from workbench.runtime.interface import PAGED

ONE_THREAD = True  # see conftest.one_thread
MLA, CACHED_MLA = "workbench.torch_mla.default", "workbench.torch_cached_mla.default"


def mla_entries(**mla_config):
    """The default pipeline with insert_cached_mla_attention right after insert_cached_attention."""
    tree = load_default_yaml()
    items = list(tree["transforms"].items())
    i = [k for k, _ in items].index("insert_cached_attention")
    items.insert(i + 1, ("insert_cached_mla_attention", {"stage": "cache_init", **mla_config}))
    tree["transforms"] = dict(items)
    return resolve_pipeline(base=tree)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_q_lora"])
def test_export_routes_attention_through_torch_mla(arch):
    loaded = load_model(f"tiny:{arch}")
    wb = Workbench(loaded, numerics=False)
    snap = wb.step()
    assert snap.key == "export_to_gm"
    hist, layers = snap.op_histogram, loaded.config.num_hidden_layers
    assert hist.get(MLA) == layers and hist.get("aten.scaled_dot_product_attention.default", 0) == 0
    assert "canonical_deepseek_v2_mla" in snap.info.details["patches"]
    eager = CausalLMLogits(loaded.model)
    for b, s in ((2, 16), (3, 5)):
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), wb.forward(*batch.args)
        assert ref.abs().mean() > 0.05
        assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_canonical_forward_matches_hf(interleave):
    """The V3 patch on HF's own DeepseekV3Attention modules, inside the whole model (so the rotary
    embedding, masks and call signature are HF's), with and without ``rope_interleave``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from workbench.models.tiny_families.mla import MLA_SIZES

    cfg = DeepseekV3Config(**{k: v for k, v in MLA_SIZES.items() if k != "topk_method"}, q_lora_rank=24,
                           rope_interleave=interleave, n_group=1, topk_group=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    eager = CausalLMLogits(model)
    batch = make_batch(cfg.vocab_size, 2, 9, seed=3)
    with torch.no_grad():
        ref = eager(*batch.args)
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(cos_sin_mla_forward, layer.self_attn)
        out = eager(*batch.args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


#: The families that copy DeepSeek-V3's MLA (tiny configs: models/tiny_families/mla.py), each at
#: another point of MLA's shape space, and the rope_interleave settings their HF forward honours.
COS_SIN_FAMILIES = [("glm4_moe_lite", True), ("glm4_moe_lite", False), ("minicpm3", None), ("youtu", False),
                    ("youtu", True), ("longcat_flash", None)]


def _mla_modules(model):
    return [m for m in model.modules() if type(m).__name__ in COS_SIN_ROPE]


@pytest.mark.parametrize("arch,interleave", COS_SIN_FAMILIES)
def test_cos_sin_mla_canonical_forward_matches_hf(arch, interleave):
    """The canonical forward on each family's own HF attention modules, inside the whole model, equals
    HF's logits; MiniCPM3 rotates halves and LongCat-Flash interleaves whatever their configs say
    (``COS_SIN_ROPE``), which the same check proves by setting ``rope_interleave`` on their configs;
    LongCat-Flash's LoRA scales are applied."""
    from workbench.models.tiny import TINY_ARCHS

    cfg = TINY_ARCHS[arch]()
    cfg.rope_interleave = bool(interleave)  # MiniCPM3, LongCat: set too, and ignored (their HF forwards never read it)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).eval()
    attn = _mla_modules(model)
    assert attn
    eager = CausalLMLogits(model)
    batch = make_batch(cfg.vocab_size, 2, 9, seed=3)
    with torch.no_grad():
        ref = eager(*batch.args)
        for a in attn:
            a.forward = types.MethodType(cos_sin_mla_forward, a)
        out = eager(*batch.args)
    assert ref.abs().mean() > 0.05
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted({a for a, _ in COS_SIN_FAMILIES}))
def test_cos_sin_mla_families_export_torch_mla(arch):
    """Export routes every attention layer of these families through ``torch_mla`` (no SDPA): the
    latent is what the cache stage then caches (the cached greedy tokens: test_generate's sweep,
    which also checks the latent cache took every layer)."""
    loaded = load_model(f"tiny:{arch}")
    snap = Workbench(loaded, numerics=False).step()
    hist = snap.op_histogram
    assert hist.get(MLA) == len(_mla_modules(loaded.model))
    assert hist.get("aten.scaled_dot_product_attention.default", 0) == 0
    assert "canonical_cos_sin_mla" in snap.info.details["patches"]


@pytest.fixture(scope="module")
def mla_bench():
    """tiny:deepseek_v2 through the whole pipeline with insert_cached_mla_attention (numerics on)."""
    wb = Workbench("tiny:deepseek_v2", entries=mla_entries())
    wb.run()
    return wb


def _snapshot(wb, key):
    return next(s for s in wb.snapshots if s.key == key)


def test_cache_stage_caches_the_latent(mla_bench):
    cfg = mla_bench.ctx.loaded.config
    layers, size = cfg.num_hidden_layers, mla_bench.ctx.dtype.itemsize
    snap = _snapshot(mla_bench, "insert_cached_mla_attention")
    assert snap.info.num_matches == layers
    latent = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
    per_head = layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * size
    d = snap.info.details
    assert (d["bytes_per_token"], d["bytes_per_token_per_head_kv"]) == (latent, per_head)
    assert d["saving_ratio"] == pytest.approx(per_head / latent, abs=1e-3) and d["saving_ratio"] > 1
    assert snap.op_histogram.get(CACHED_MLA) == layers and snap.op_histogram.get(MLA, 0) == 0
    assert snap.numerics is not None and snap.numerics.ok and snap.numerics.rmse_ratio <= 1e-6
    # The allocated pool: one [num_pages, page_size, r + dr] tensor per layer, nothing per head.
    cache = mla_bench.ctx.cache
    assert sorted(s.name for s in cache.specs) == [f"mla_cache_{i}" for i in range(layers)]
    assert all(s.kind == PAGED and s.shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim,) for s in cache.specs)
    assert cache.config.bytes_per_token() == latent
    assert all(cache.tensors[s.name].shape[2:] == s.shape for s in cache.specs)
    # insert_cached_attention found nothing to cache and nothing uncached to complain about.
    att = _snapshot(mla_bench, "insert_cached_attention")
    assert att.info.num_matches == 0 and "uncached_attention" not in att.info.details


def test_generate_equals_hf_greedy(mla_bench):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 13)]
    out = mla_bench.generate(prompts, max_new_tokens=16, stop_token_ids=[])
    model = mla_bench.ctx.loaded.model
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(model, p, 16)
    worst, compared, mixed = decode_vs_reforward(mla_bench, prompts + [prompts[0][:3]], steps=4, join_at=1)
    assert compared == 12 and mixed > 0 and worst <= 1e-5, worst


def test_other_backends_are_refused():
    transform = TRANSFORMS.get("insert_cached_mla_attention")(
        InsertCachedAttentionConfig(stage="cache_init", backend="flashinfer"))
    with pytest.raises(ValueError, match="no 'flashinfer' backend.*'torch'"):
        transform._apply(fx.symbolic_trace(torch.nn.Identity()), ctx=None)
