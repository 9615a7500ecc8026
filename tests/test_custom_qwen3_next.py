"""Custom Qwen3-Next (``workbench/models/custom/modeling_qwen3_next.py``) against HF's own classes,
bottom-up (``workbench.testing.equivalence``), then through the factory and the whole pipeline.

Weights: ``tiny:qwen3_next`` (gated delta net / full attention alternating, 4 layers, grouped value
heads, partial rotary, MoE with a gated shared expert) with unit-gain random weights
(``custom_model_support.randomize``: zero-centred norm weights become 0.1 noise, so ``1 + w`` really
differs from 1), loaded into the custom model with HF's state dict, strictly. The block/layer/model
levels use ``mlp_only_layers=[1]`` so one layer has a dense MLP: every (token mixer, MLP) kind
appears -- (delta net, MoE), (attention, dense), (attention, MoE).

Tolerances (fp32): RMSE ratio <= 1e-5 for the delta net, attention, MoE, layers and logits (HF's
delta rule runs chunks of 64 with a triangular solve, ``torch_gated_delta_rule`` its own chunked
form: the same recurrence in another fp32 order; measured <= 2e-6 on the logits, at 70 tokens = two
of HF's chunks too); identical math (norms, MLP, RoPE tables) element-wise to 1e-6. bf16 logits:
measured 0.0 here, held to 1e-2 (the seed's bound for a whole bf16 model is a few 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from custom_model_support import TINY_REGISTRY, hf_and_custom, probe_inputs, randomize, spelled_out, workbench_ops
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.custom.modeling_qwen3_next import Qwen3NextForCausalLM
from workbench.models.export_contract import CausalLMLogits
from workbench.pipeline.graph.utils import op_histogram
from workbench.testing import check_block, check_export, check_layer, check_model

ONE_THREAD = True  # see conftest.one_thread
TOL = 1e-5  # fp32 RMSE ratio for every non-identical level (module docstring)
CUSTOM_CLASS = "custom Qwen3NextForCausalLM (workbench.models.custom.modeling_qwen3_next)"
MIXED_MLP = {"mlp_only_layers": [1]}  # layer 1 (full attention) gets a dense MLP


@pytest.fixture(scope="module")
def pair():
    hf, custom, config = hf_and_custom("qwen3_next", seed=0, **MIXED_MLP)
    assert config.layer_types[:2] == ["linear_attention", "full_attention"]
    torch.manual_seed(0)
    x = torch.randn(2, 70, config.hidden_size)  # 70 tokens: two of HF's 64-token delta-rule chunks
    pos = torch.arange(70).expand(2, 70)
    return hf, custom, config, x, pos, hf.model.rotary_emb(x, pos)


def _attn_kwargs(cos, sin):
    return {"position_embeddings": (cos, sin), "attention_mask": None}


# ------------------------------------------------------------------------------------------ blocks


def test_blocks_rope_norms_mlp(pair):
    hf, custom, config, x, pos, (cos, sin) = pair
    c_cos, c_sin = custom.model.rotary_emb(x, pos)
    assert cos.shape[-1] == config.head_dim // 4  # partial rotary: a quarter of each head
    torch.testing.assert_close(c_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(c_sin, sin, rtol=0, atol=1e-6)
    assert custom.model.norm.weight.abs().max() > 0  # zero-centred weights really are not zero here
    check_block(hf.model.norm, custom.model.norm, x, tol=1e-6, identical_math=True)
    heads = x.reshape(2, 70, -1, config.linear_value_head_dim)
    gate = torch.randn_like(heads)
    check_block(hf.model.layers[0].linear_attn.norm, custom.model.layers[0].linear_attn.norm, heads, gate,
                tol=1e-6, identical_math=True)
    check_block(hf.model.layers[1].mlp, custom.model.layers[1].mlp, x, tol=1e-6, identical_math=True)


def test_block_gated_delta_net(pair):
    hf, custom, _, x, _, _ = pair
    check_block(hf.model.layers[0].linear_attn, custom.model.layers[0].linear_attn, x, tol=TOL)


def test_block_gated_attention(pair):
    hf, custom, _, x, _, (cos, sin) = pair
    check_block(hf.model.layers[1].self_attn, custom.model.layers[1].self_attn, x, cos=cos, sin=sin, tol=TOL,
                ref_kwargs=_attn_kwargs(cos, sin))


def test_block_router_experts_moe(pair):
    hf, custom, config, x, _, _ = pair
    tokens = x.reshape(-1, config.hidden_size)
    hf_moe, moe = hf.model.layers[0].mlp, custom.model.layers[0].mlp
    _, hf_w, hf_ids = hf_moe.gate(tokens)
    w, ids = moe.gate(tokens)
    e = config.num_experts
    dense = lambda w_, i_: torch.zeros(tokens.shape[0], e).scatter(1, i_, w_.float())  # noqa: E731
    torch.testing.assert_close(dense(w, ids), dense(hf_w, hf_ids), rtol=0, atol=1e-6)
    check_block(hf_moe.experts, moe.experts, tokens, hf_ids, hf_w, tol=TOL)
    check_block(hf_moe, moe, x, tol=TOL)  # routed experts + sigmoid-gated shared expert


# ------------------------------------------------------------------------------ layers, model, export


def test_each_layer_type(pair):
    hf, custom, _, x, _, (cos, sin) = pair
    kinds = {i: (custom.model.layers[i].layer_type, type(custom.model.layers[i].mlp).__name__) for i in (0, 1, 3)}
    assert kinds == {0: ("linear_attention", "SparseMoE"), 1: ("full_attention", "SwiGLUMLP"),
                     3: ("full_attention", "SparseMoE")}
    for i in kinds:
        check_layer(hf.model.layers[i], custom.model.layers[i], x, cos=cos, sin=sin, tol=TOL,
                    ref_kwargs=_attn_kwargs(cos, sin))


@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 70)])
def test_model_logits(pair, batch, seq):
    hf, custom, config, *_ = pair
    ids, pos = probe_inputs(config.vocab_size, batch, seq, seed=batch * 100 + seq)
    check_model(hf, custom, ids, pos, tol=TOL)


def test_model_bf16():
    hf, custom, config = hf_and_custom("qwen3_next", seed=1, dtype=torch.bfloat16, **MIXED_MLP)
    ids, pos = probe_inputs(config.vocab_size, 2, 12, seed=5)
    check_model(hf, custom, ids, pos, tol=1e-2)


def test_export_holds_only_canonical_ops(pair):
    """torch.export with dynamic batch/seq, eager-equal at two shapes; the graph's op histogram: each
    mechanism is its canonical op (one per layer / per norm), nothing spelled out."""
    _, custom, config, *_ = pair
    ids, pos = probe_inputs(config.vocab_size, 2, 9, seed=3)
    gm = check_export(CausalLMLogits(custom), ids, pos, second=(3, 5), tol=TOL)
    hist = op_histogram(gm)
    linear = config.layer_types.count("linear_attention")
    full = config.layer_types.count("full_attention")
    moe = config.num_hidden_layers - len(config.mlp_only_layers)
    assert workbench_ops(hist) == {
        "torch_gated_delta_rule": linear, "torch_causal_conv1d": linear,
        "torch_attention": full, "torch_rope_with_explicit_cos_sin": full,
        # input + post-attention norms per layer, q/k norms per attention layer, the gated norm per
        # delta net, the final norm
        "torch_rmsnorm": 2 * config.num_hidden_layers + 2 * full + linear + 1,
        "torch_moe_topk_softmax": moe, "torch_moe_fused": moe,
        "torch_swiglu_mlp": moe + len(config.mlp_only_layers),  # shared experts + dense MLPs
    }
    assert spelled_out(hist) == {}


# ------------------------------------------------------------------------------ factory and pipeline


@pytest.fixture(scope="module")
def bench():
    """tiny:qwen3_next through the factory (custom model picked) and the whole default pipeline."""
    loaded = load_model("tiny:qwen3_next", tiny_registry=TINY_REGISTRY)
    randomize(loaded.model, seed=2)  # in place: the custom twin shares these tensors
    wb = Workbench(loaded)
    wb.run()
    return wb


def test_factory_builds_the_custom_model_sharing_the_hf_tensors(bench):
    loaded = bench.loaded
    assert isinstance(loaded.export_model, Qwen3NextForCausalLM)
    hf_tensors = {**dict(loaded.model.named_parameters()), **dict(loaded.model.named_buffers())}
    for name, t in [*loaded.export_model.named_parameters(), *loaded.export_model.named_buffers()]:
        assert t is hf_tensors[name], name


def test_pipeline_caches_every_layer_and_generates_hf_greedy_tokens(bench):
    snap = bench.snapshot("export_to_gm")
    assert snap.info.details["model_class"] == CUSTOM_CLASS and spelled_out(snap.op_histogram) == {}
    bad = [(s.key, s.numerics) for s in bench.snapshots if s.numerics is not None and not s.numerics.ok]
    assert not bad and all(s.numerics.rmse_ratio <= TOL for s in bench.snapshots if s.numerics is not None)
    matches = {k: bench.snapshot(k).info.num_matches for k in
               ("insert_cached_attention", "insert_cached_causal_conv", "insert_cached_gated_delta_rule")}
    assert matches == {"insert_cached_attention": 2, "insert_cached_causal_conv": 2,
                       "insert_cached_gated_delta_rule": 2}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 13)]
    out = bench.generate(prompts, max_new_tokens=16, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(bench.loaded.model, p, 16)


def test_opting_out_exports_the_hf_class_with_its_sdpa():
    loaded = load_model("tiny:qwen3_next", custom_models=False)
    assert loaded.export_model is None
    snap = Workbench(loaded, numerics=False).step()
    assert snap.info.details["model_class"] == \
        "Qwen3NextForCausalLM (transformers.models.qwen3_next.modeling_qwen3_next)"
    # HF's spelling: attention as SDPA and norms as pow/mean/rsqrt chains, left to the pattern matchers
    assert snap.op_histogram.get("aten.scaled_dot_product_attention.default") == 2
    assert spelled_out(snap.op_histogram).keys() >= {"aten.scaled_dot_product_attention.default",
                                                     "aten.rsqrt.default"}
