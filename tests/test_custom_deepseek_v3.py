"""Custom DeepSeek-V3 (``workbench/models/custom/modeling_deepseek_v3.py``) against HF's own classes,
bottom-up (``workbench.testing.equivalence``), then through the factory and the whole pipeline.

Weights: ``tiny:deepseek_v3`` (tiny_families/custom.py: YaRN RoPE with mscale_all_dim, interleaved
rope pairs, low-rank queries, 4 layers = 1 dense + 3 MoE of 8 experts in 4 groups) with unit-gain
random weights and a non-zero ``e_score_correction_bias`` (``custom_model_support.randomize``), loaded
into the custom model with HF's state dict, strictly.

Tolerances (fp32): the custom model computes the same fp32 arithmetic as HF with some reductions in
another order (SDPA over expanded K/V vs ``torch_mla``'s, index_add per expert vs a per-slot sum),
so every level is held to RMSE ratio <= 1e-5 (``assert_rmse_close``: rmse(diff) / rmse(reference);
measured ~2e-7); blocks of identical math (norms, MLP, RoPE tables) element-wise to 1e-6. bf16: the
logits RMSE ratio measured 0.0 here (the two models round at the same points), held to 1e-2 (other
CPUs may order bf16 reductions differently; the seed's bound for a whole bf16 model is a few 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from custom_model_support import TINY_REGISTRY, hf_and_custom, probe_inputs, randomize, spelled_out, workbench_ops
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.custom.modeling_deepseek_v3 import DeepseekV3ForCausalLM
from workbench.models.export_contract import CausalLMLogits
from workbench.pipeline.graph.utils import op_histogram
from workbench.testing import check_block, check_export, check_layer, check_model

ONE_THREAD = True  # see conftest.one_thread
TOL = 1e-5  # fp32 RMSE ratio for every non-identical level (module docstring)
CUSTOM_CLASS = "custom DeepseekV3ForCausalLM (workbench.models.custom.modeling_deepseek_v3)"


@pytest.fixture(scope="module")
def pair():
    hf, custom, config = hf_and_custom("deepseek_v3", seed=0)
    torch.manual_seed(0)
    x = torch.randn(2, 11, config.hidden_size)
    pos = torch.arange(3, 14).expand(2, 11)  # positions need not start at 0 (a later chunk)
    cos, sin = hf.model.rotary_emb(x, pos)
    return hf, custom, config, x, (cos, sin)


# ------------------------------------------------------------------------------------------ blocks


def test_blocks_rope_norm_mlp(pair):
    hf, custom, config, x, (cos, sin) = pair
    pos = torch.arange(3, 14).expand(2, 11)
    c_cos, c_sin = custom.model.rotary_emb(x, pos)
    assert hf.model.rotary_emb.attention_scaling != 1.0 or custom.model.layers[0].self_attn.scaling != \
        (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5  # YaRN really changes something
    torch.testing.assert_close(c_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(c_sin, sin, rtol=0, atol=1e-6)
    assert custom.model.layers[0].self_attn.scaling == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    check_block(hf.model.norm, custom.model.norm, x, tol=1e-6, identical_math=True)
    check_block(hf.model.layers[0].mlp, custom.model.layers[0].mlp, x, tol=1e-6, identical_math=True)


def test_block_latent_attention(pair):
    hf, custom, _, x, (cos, sin) = pair
    for i in (0, 1):
        check_block(hf.model.layers[i].self_attn, custom.model.layers[i].self_attn, x, cos=cos, sin=sin, tol=TOL,
                    ref_kwargs={"position_embeddings": (cos, sin), "attention_mask": None})


def _dense(weights, ids, num_experts):
    """[T, k] routing -> [T, E] (order of the k slots does not matter)."""
    return torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype).scatter(1, ids, weights)


def test_block_router_experts_moe(pair):
    hf, custom, config, x, _ = pair
    tokens = x.reshape(-1, config.hidden_size)
    hf_moe, moe = hf.model.layers[1].mlp, custom.model.layers[1].mlp
    _, hf_w, hf_ids = hf_moe.gate(tokens)
    w, ids = moe.gate(tokens)
    e = config.n_routed_experts
    torch.testing.assert_close(_dense(w, ids, e), _dense(hf_w, hf_ids, e), rtol=0, atol=1e-6)
    # the correction bias really steers the choice (without it other experts win for some tokens)
    bias = moe.gate.e_score_correction_bias.clone()
    moe.gate.e_score_correction_bias.zero_()
    try:
        _, unbiased_ids = moe.gate(tokens)
    finally:
        moe.gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(_dense(torch.ones_like(w), unbiased_ids, e), _dense(torch.ones_like(w), ids, e))
    check_block(hf_moe.experts, moe.experts, tokens, hf_ids, hf_w, tol=TOL)
    check_block(hf_moe, moe, x, tol=TOL)


# ------------------------------------------------------------------------------ layers, model, export


def test_layers_dense_and_moe(pair):
    hf, custom, config, x, (cos, sin) = pair
    assert config.first_k_dense_replace == 1 and type(custom.model.layers[0].mlp).__name__ == "SwiGLUMLP"
    for i in (0, 1):  # the two layer types: dense MLP, MoE
        check_layer(hf.model.layers[i], custom.model.layers[i], x, cos=cos, sin=sin, tol=TOL,
                    ref_kwargs={"position_embeddings": (cos, sin), "attention_mask": None})


@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 37)])
def test_model_logits(pair, batch, seq):
    hf, custom, config, _, _ = pair
    ids, pos = probe_inputs(config.vocab_size, batch, seq, seed=batch * 100 + seq)
    check_model(hf, custom, ids, pos, tol=TOL)


def test_model_bf16():
    hf, custom, config = hf_and_custom("deepseek_v3", seed=1, dtype=torch.bfloat16)
    ids, pos = probe_inputs(config.vocab_size, 2, 12, seed=5)
    check_model(hf, custom, ids, pos, tol=1e-2)


def test_contract_refuses_missing_positions_and_runtime_arguments(pair):
    _, custom, config, _, _ = pair
    ids, pos = probe_inputs(config.vocab_size, 1, 4, seed=0)
    with pytest.raises(ValueError, match="position_ids is required"):
        custom(ids)
    with pytest.raises(ValueError, match=r"\['attention_mask'\]"):
        custom(ids, pos, attention_mask=torch.ones_like(ids))
    assert custom(ids, pos, use_cache=False, attention_mask=None).logits.shape == (1, 4, config.vocab_size)


def test_export_holds_only_canonical_ops(pair):
    """torch.export with dynamic batch/seq, eager-equal at two shapes; the graph's op histogram: MLA,
    RoPE, RMSNorm, MLP and MoE are canonical ops (one per layer / per norm), nothing spelled out."""
    _, custom, config, _, _ = pair
    ids, pos = probe_inputs(config.vocab_size, 2, 9, seed=3)
    gm = check_export(CausalLMLogits(custom), ids, pos, second=(3, 5), tol=TOL)
    hist = op_histogram(gm)
    layers, moe = config.num_hidden_layers, config.num_hidden_layers - config.first_k_dense_replace
    assert workbench_ops(hist) == {
        "torch_mla": layers, "torch_rope_with_qk_interleaving": layers,
        # per layer: input, post-attention, q_a and kv_a norms; plus the final norm
        "torch_rmsnorm": 4 * layers + 1,
        "torch_swiglu_mlp": config.first_k_dense_replace + moe,  # dense MLPs + shared experts
        "torch_moe_fused": moe,
    }
    assert spelled_out(hist) == {}
    # projections stay plain linears: q_a, q_b, kv_a, o per layer (kv_b_proj's weight goes into torch_mla),
    # the routers and lm_head
    assert hist["aten.linear.default"] == 4 * layers + moe + 1


# ------------------------------------------------------------------------------ factory and pipeline


@pytest.fixture(scope="module")
def bench():
    """tiny:deepseek_v3 through the factory (custom model picked) and the whole default pipeline."""
    loaded = load_model("tiny:deepseek_v3", tiny_registry=TINY_REGISTRY)
    randomize(loaded.model, seed=2)  # in place: the custom twin shares these tensors
    wb = Workbench(loaded)
    wb.run()
    return wb


def test_factory_builds_the_custom_model_sharing_the_hf_tensors(bench):
    loaded = bench.loaded
    assert type(loaded.model).__module__.startswith("transformers.") and isinstance(loaded.export_model,
                                                                                  DeepseekV3ForCausalLM)
    hf_tensors = {**dict(loaded.model.named_parameters()), **dict(loaded.model.named_buffers())}
    for name, t in [*loaded.export_model.named_parameters(), *loaded.export_model.named_buffers()]:
        assert t is hf_tensors[name], name  # one copy of the weights, the checkpoint's names
    assert "export=custom DeepseekV3ForCausalLM" in repr(loaded)


def test_export_snapshot_names_the_custom_model_and_stamps_its_moe_layers(bench):
    snap = bench.snapshot("export_to_gm")
    assert snap.info.details["model_class"] == CUSTOM_CLASS
    assert snap.info.details["summary"].startswith("custom DeepseekV3ForCausalLM traced on meta")
    # layers 1-3 are the same MoE layer: layer 3 is stamped from layer 2 (HF's own class is not stampable)
    assert "stamped" in snap.info.details["layers"], snap.info.details["layers"]
    assert snap.op_histogram.get("workbench.torch_mla.default") == 4 and spelled_out(snap.op_histogram) == {}


def test_pipeline_numerics_and_greedy_tokens_equal_hf(bench):
    bad = [(s.key, s.numerics) for s in bench.snapshots if s.numerics is not None and not s.numerics.ok]
    assert not bad and all(s.numerics.rmse_ratio <= TOL for s in bench.snapshots if s.numerics is not None)
    cached = bench.snapshot("insert_cached_mla_attention")
    assert cached.info.num_matches == 4
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 13)]
    out = bench.generate(prompts, max_new_tokens=16, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(bench.loaded.model, p, 16)


def test_opting_out_exports_the_hf_class():
    loaded = load_model("tiny:deepseek_v3", tiny_registry=TINY_REGISTRY, custom_models=False)
    assert loaded.export_model is None and loaded.model_to_export is loaded.model
    snap = Workbench(loaded, numerics=False).step()
    assert snap.info.details["model_class"] == \
        "DeepseekV3ForCausalLM (transformers.models.deepseek_v3.modeling_deepseek_v3)"
    assert snap.info.details["layers"].startswith("full export")


def _gelu_mlp():
    config = TINY_REGISTRY["deepseek_v3"]()
    config.hidden_act = "gelu"
    return config


def test_a_config_the_custom_model_refuses_falls_back_to_the_hf_class_with_a_note(caplog):
    # a GELU MLP: HF's class runs it, the custom rewrite (SwiGLU canonical ops) does not implement it.
    # (Fewer KV heads than heads, the other refusal, HF's class cannot run either in transformers 5.23:
    # its MLA keys have every head and repeat_kv doubles them.)
    registry = {**TINY_REGISTRY, "deepseek_v3": _gelu_mlp}
    with caplog.at_level("WARNING", logger="workbench"):
        loaded = load_model("tiny:deepseek_v3", tiny_registry=registry)
    assert loaded.export_model is None and loaded.model_to_export is loaded.model
    assert "hidden_act='gelu'" in loaded.custom_fallback
    assert "exporting HF's DeepseekV3ForCausalLM instead" in loaded.custom_fallback
    assert any("exporting HF's DeepseekV3ForCausalLM instead" in r.getMessage() for r in caplog.records)
    bench = Workbench(loaded, numerics=False)
    snap = bench.step()
    assert snap.info.details["model_class"].startswith(
        "DeepseekV3ForCausalLM (transformers.models.deepseek_v3.modeling_deepseek_v3); custom DeepseekV3ForCausalLM"
    )
    bench.run()
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    out = bench.generate([prompt], max_new_tokens=8, stop_token_ids=[])
    assert out.results[0].token_ids == _hf_greedy(loaded.model, prompt, 8)

