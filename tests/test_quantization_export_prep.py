"""The quant_utils functions that prepare a quantized model for export: KV-cache scales, the state
dict, ``hf_quant_config.json``, re-smoothing and fusion preparation -- on a real (tiny, random) HF
Llama with quantizers attached and calibrated from its own activations."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from workbench.ops.quant import codecs as C
from workbench.quantization import (
    TensorQuantizer, adjust_attn_amax_values, all_items_same, apply_pre_quant_scale, attach_kv_quantizers,
    attach_quantizers, calibrating, fuse_prequant_layernorm, get_kv_cache_bias, get_kv_cache_dtype,
    get_kv_cache_scaling_factor, get_prequant_scaling_factor, get_quant_config, get_quantization_format,
    get_scaling_factor_from_weight, postprocess_state_dict, preprocess_linear_fusion, process_layer_quant_config,
    quantize_linears, resmooth_and_get_scale,
)

ONE_THREAD = True


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _positive(k, seed):
    return torch.rand(k, generator=torch.Generator().manual_seed(seed)) + 0.25


def _tiny_llama(fmt="nvfp4", kv="FP8", block_size=None):
    """2-layer Llama (hidden 64, tied embeddings), every linear but lm_head quantized as ``fmt``,
    FP8/INT8 KV quantizers calibrated from the real k_proj / v_proj outputs of a forward pass."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    quantize_linears(model, fmt, block_size=block_size)
    hooks = []
    for layer in model.model.layers:
        attn = attach_kv_quantizers(layer.self_attn, kv)
        for proj, quantizer in ((attn.k_proj, attn.k_bmm_quantizer), (attn.v_proj, attn.v_bmm_quantizer)):
            hooks.append(proj.register_forward_hook(lambda m, args, out, q=quantizer: q.collect(out)))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with calibrating(model):
        model(ids)
    for h in hooks:
        h.remove()
    return model


# ------------------------------------------------------------------------------------------ KV cache
def test_kv_cache_dtype_from_the_bmm_or_output_quantizers():
    def attn(*quantizers):
        m = nn.Module()
        for name, q in zip(("k_bmm_quantizer", "v_bmm_quantizer"), quantizers):
            setattr(m, name, q)
        return m

    assert get_kv_cache_dtype(attach_kv_quantizers(nn.Module(), "FP8")) == "FP8"
    assert get_kv_cache_dtype(attach_kv_quantizers(nn.Module(), "INT8")) == "INT8"
    assert get_kv_cache_dtype(attach_kv_quantizers(nn.Module(), "NVFP4")) == "NVFP4"
    assert get_kv_cache_dtype(attach_kv_quantizers(nn.Module(), "NVFP4", affine=True)) == "NVFP4_AFFINE"
    assert get_kv_cache_dtype(nn.Linear(4, 4)) is None
    assert get_kv_cache_dtype(attn(TensorQuantizer((4, 3), enabled=False), TensorQuantizer(8, enabled=False))) is None
    # FP8 anywhere wins over INT8 (ModelOpt's order), across a list of modules
    assert get_kv_cache_dtype([attach_kv_quantizers(nn.Module(), "INT8"), attn(TensorQuantizer((4, 3)))]) == "FP8"
    lin = attach_quantizers(nn.Linear(8, 8), "fp8")
    lin.output_quantizer = TensorQuantizer((4, 3))  # the older k_proj/v_proj output-quantizer path
    assert get_kv_cache_dtype(lin) == "FP8"


def test_kv_cache_scaling_factors_from_real_keys_and_values():
    model = _tiny_llama(kv="INT8")
    attn = model.model.layers[0].self_attn
    x = _randn(3, 64)
    k_amax, v_amax = attn.k_bmm_quantizer.amax, attn.v_bmm_quantizer.amax
    assert k_amax > 0 and v_amax > 0
    k_scale, v_scale = get_kv_cache_scaling_factor(attn)
    assert k_scale == k_amax / 127 and v_scale == v_amax / 127  # INT8: not clamped
    fp8 = attach_kv_quantizers(attn, "FP8")
    fp8.k_bmm_quantizer.collect(attn.k_proj(x))
    fp8.v_bmm_quantizer.amax = torch.tensor(3 * 448.0)
    with pytest.warns(UserWarning, match="Large KV activation"):
        k_scale, v_scale = get_kv_cache_scaling_factor(fp8)
    assert fp8.k_bmm_quantizer.amax / 448 < 1 and k_scale == 1.0  # FP8 scales are at least 1
    assert v_scale == 3.0
    assert get_kv_cache_scaling_factor(nn.Linear(2, 2)) == [None, None]


def test_kv_cache_bias_only_for_affine_quantizers():
    affine = attach_kv_quantizers(nn.Module(), "NVFP4", affine=True)
    affine.k_bmm_quantizer.bias_value = torch.tensor(0.25)
    k_bias, v_bias = get_kv_cache_bias(affine)
    assert k_bias == 0.25 and v_bias == 0.0
    assert get_kv_cache_bias(attach_kv_quantizers(nn.Module(), "FP8")) == [None, None]
    assert get_kv_cache_bias(nn.Module()) == [None, None]


# ---------------------------------------------------------------------------------------- state dict
def test_postprocess_state_dict_on_a_concrete_dict():
    weight, bias, pqs = _randn(4, 8), torch.tensor(0.5), _positive(8, 2)
    tied = _randn(16, 8)
    state = {
        "a.weight": weight, "a.weight_quantizer._amax": torch.tensor(2.0), "a.input_quantizer._amax": torch.tensor(3.0),
        "a.output_quantizer._amax": torch.tensor(4.0), "a.input_quantizer._pre_quant_scale": pqs,
        "attn.k_bmm_quantizer._amax": torch.tensor(896.0), "attn.v_bmm_quantizer._amax": torch.tensor(100.0),
        "attn.k_bmm_quantizer._bias_value": bias, "b.weight_scale": torch.ones(1, 2, 3),
        "embed.weight": tied, "lm_head.weight": tied,
    }
    before = dict(state)
    with pytest.warns(UserWarning) as caught:
        out = postprocess_state_dict(state, 448.0, "FP8")
    messages = " ".join(str(w.message) for w in caught)
    assert "Large KV activations at 'attn.k_bmm_quantizer._amax'" in messages and "tied" in messages
    assert state == before  # not modified
    assert list(out) == ["a.weight", "a.pre_quant_scale", "attn.k_proj.k_scale", "attn.v_proj.v_scale",
                         "attn.k_proj.k_bias", "b.weight_scale", "embed.weight"]
    assert out["a.weight"] is weight and out["a.pre_quant_scale"] is pqs and out["attn.k_proj.k_bias"] is bias
    assert out["attn.k_proj.k_scale"] == 2.0 and out["attn.v_proj.v_scale"] == 1.0  # 100/448 -> at least 1
    assert out["b.weight_scale"].shape == (2, 3)
    nvfp4 = postprocess_state_dict({"attn.v_bmm_quantizer._amax": torch.tensor(100.0)}, 6 * 448.0, "NVFP4")
    assert nvfp4["attn.v_proj.v_scale"] == torch.tensor(100.0) / (6 * 448)  # NVFP4: the real value
    with pytest.raises(ValueError, match="KV-cache format"):
        postprocess_state_dict({"attn.k_bmm_quantizer._amax": torch.tensor(1.0)}, 448.0, None)
    with pytest.raises(ValueError, match="maxbound"):
        postprocess_state_dict({"attn.k_bmm_quantizer._amax": torch.tensor(1.0)}, 0.0, "FP8")


def test_postprocess_state_dict_of_a_quantized_llama():
    model = _tiny_llama("int4_awq", block_size=32)
    down = model.model.layers[1].mlp.down_proj
    scale = _positive(128, 3)
    apply_pre_quant_scale(down, scale)
    state = model.state_dict()
    with pytest.warns(UserWarning, match="tied"):
        out = postprocess_state_dict(state, 448.0, "FP8")
    assert not [k for k in out if "quantizer" in k]
    assert "lm_head.weight" not in out and "model.embed_tokens.weight" in out
    for i, layer in enumerate(model.model.layers):
        for proj, q in (("k_proj.k_scale", layer.self_attn.k_bmm_quantizer), ("v_proj.v_scale",
                                                                            layer.self_attn.v_bmm_quantizer)):
            assert out[f"model.layers.{i}.self_attn.{proj}"] == torch.clamp(q.amax / 448, min=1.0)
    assert torch.equal(out["model.layers.1.mlp.down_proj.pre_quant_scale"], scale)
    plain = [k for k in state if "quantizer" not in k and k != "lm_head.weight"]
    assert all(out[k] is state[k] for k in plain)


# -------------------------------------------------------------------------------------- quant config
def test_process_layer_quant_config_mixed_precision():
    layers = {
        "model.layers.0.self_attn.q_proj.quantization": "fp8", "model.layers.0.self_attn.q_proj.awq_block_size": 0,
        "model.layers.0.mlp.down_proj.quantization": "int4_awq", "model.layers.0.mlp.down_proj.awq_block_size": 128,
        "model.layers.1.mlp.down_proj.quantization": "nvfp4", "model.layers.1.mlp.down_proj.awq_block_size": 16,
        "lm_head.quantization": None,
    }
    assert process_layer_quant_config(layers) == {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
        "quantized_layers": {
            "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
            "model.layers.0.mlp.down_proj": {"quant_algo": "W4A16_AWQ", "group_size": 128, "has_zero_point": False,
                                             "pre_quant_scale": True},
            "model.layers.1.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
        },
        "exclude_modules": ["lm_head"],
    }


def test_process_layer_quant_config_single_format_and_errors():
    layers = {"b.quantization": "nvfp4", "b.awq_block_size": 16, "a.quantization": "nvfp4", "a.awq_block_size": 16,
              "lm_head.quantization": None, "gate.quantization": None}
    assert process_layer_quant_config(layers) == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                                  "exclude_modules": ["gate", "lm_head"]}
    block_fp8 = process_layer_quant_config({"w.quantization": "fp8_pb_wo", "w.awq_block_size": 128})
    assert block_fp8 == {"quant_algo": "FP8_BLOCK", "kv_cache_quant_algo": None, "weight_block_size": [128, 128],
                         "exclude_modules": []}
    layers["a.awq_block_size"] = 32  # the same algorithm with another group size is a second config
    assert process_layer_quant_config(layers)["quant_algo"] == "MIXED_PRECISION"
    assert process_layer_quant_config({}) == {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": []}
    with pytest.raises(ValueError, match="unexpected key 'a.format'"):
        process_layer_quant_config({"a.format": "fp8"})
    with pytest.raises(ValueError, match="unsupported quantization format 'fp6'"):
        process_layer_quant_config({"a.quantization": "fp6"})


def test_get_quant_config_of_a_quantized_llama():
    model = _tiny_llama("nvfp4")
    config = get_quant_config(model)
    assert config == {
        "producer": {"name": "workbench", "version": importlib.metadata.version("workbench")},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": ["lm_head"]},
    }
    assert json.loads(json.dumps(config)) == config
    assert get_quant_config(dict(model.named_modules())) == config
    attach_quantizers(model.model.layers[0].mlp.down_proj, "int4_awq")  # mixed precision
    quantization = get_quant_config(model)["quantization"]
    assert quantization["quant_algo"] == "MIXED_PRECISION"
    layers = quantization["quantized_layers"]
    assert len(layers) == 14 and layers["model.layers.0.mlp.down_proj"]["quant_algo"] == "W4A16_AWQ"
    assert layers["model.layers.0.mlp.down_proj"]["group_size"] == 128
    assert layers["model.layers.1.mlp.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    attach_kv_quantizers(model.model.layers[1].self_attn, "INT8")
    with pytest.raises(ValueError, match="mixed KV-cache formats"):
        get_quant_config(model)
    with pytest.raises(TypeError, match="dict of name -> module"):
        get_quant_config([model])


# -------------------------------------------------------------------------------------- pre-quant scales
def test_resmooth_and_get_scale_keeps_each_ranks_product():
    w = [_randn(16, 64, seed=1), _randn(16, 64, seed=2)]
    pqs = [_positive(64, 3), _positive(64, 4)]
    merged, scales, new = resmooth_and_get_scale(torch.cat(w), pqs, 2, 32)
    assert torch.equal(new, (pqs[0] + pqs[1]) / 2)
    x = _randn(5, 64, seed=5)
    for r, chunk in enumerate(merged.chunk(2)):
        # (x * s_r) @ W_r.T == (x * s') @ (W_r * s_r / s').T: fp32, one multiply and one divide per
        # element more on one side -> relative differences of a few ulps over a 64-term sum
        torch.testing.assert_close((x * new) @ chunk.T, (x * pqs[r]) @ w[r].T, rtol=1e-5, atol=1e-5)
    assert torch.equal(scales, torch.cat([get_scaling_factor_from_weight(c, 32) for c in merged.chunk(2)]))
    given = _positive(64, 6)
    merged2, rows, same = resmooth_and_get_scale(torch.cat(w), pqs, 2, 0, given, "int8_sq")
    assert same is given and rows.shape == (32,)
    torch.testing.assert_close((x * given) @ merged2[:16].T, (x * pqs[0]) @ w[0].T, rtol=1e-5, atol=1e-5)
    _, fp8_scales, _ = resmooth_and_get_scale(torch.cat(w), pqs, 2, 16, quantization="nvfp4_awq")
    assert fp8_scales.dtype == torch.float8_e4m3fn and fp8_scales.shape == (32, 4)
    first = C.nvfp4_quantize(merged[:16], None, 16)[1]  # rank 0's scales, relative to its own global scale
    assert torch.equal(fp8_scales[:16].view(torch.uint8), first.view(torch.uint8))
    with pytest.raises(ValueError, match="one pre_quant_scale per rank"):
        resmooth_and_get_scale(torch.cat(w), pqs[:1], 2, 32)
    with pytest.raises(ValueError, match="K=64"):
        resmooth_and_get_scale(torch.cat(w), pqs, 2, 32, torch.ones(32))
    with pytest.raises(ValueError, match="no pre-quant scale"):
        resmooth_and_get_scale(torch.cat(w), pqs, 2, 32, quantization="fp8")


def _awq_projections(scales, fmt="int4_awq", seed=0):
    mods = []
    for i, s in enumerate(scales):
        lin = nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            lin.weight.copy_(_randn(32, 64, seed=seed + i))
        attach_quantizers(lin, fmt, block_size=32 if fmt == "int4_awq" else None)
        apply_pre_quant_scale(lin, s)
        mods.append(lin)
    return mods


@pytest.mark.parametrize("norm", [LlamaRMSNorm(64), nn.LayerNorm(64)], ids=["rmsnorm", "layernorm"])
def test_fuse_prequant_layernorm_leaves_norm_plus_linears_unchanged(norm):
    with torch.no_grad():
        norm.weight.copy_(_positive(64, 7))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(_randn(64, seed=8))
    mods = _awq_projections([_positive(64, 9)] * 3)
    x = _randn(4, 7, 64, seed=10)
    before = [m(norm(x)) for m in mods]
    fuse_prequant_layernorm(norm, mods)
    # weight-only int4 (the weights and their quantization are untouched); norm(x) * (w * s) vs
    # (norm(x) * w) * s differ by fp32 rounding only
    for m, ref in zip(mods, before):
        torch.testing.assert_close(m(norm(x)), ref, rtol=1e-5, atol=1e-5)
        assert get_prequant_scaling_factor(m) is None and m.fused_with_layernorm


def test_fuse_prequant_layernorm_needs_one_scale_and_keeps_nvfp4_awq():
    norm = LlamaRMSNorm(64)
    mods = _awq_projections([_positive(64, 1), _positive(64, 2)], fmt="nvfp4_awq")
    with pytest.raises(ValueError, match="preprocess_linear_fusion"):
        fuse_prequant_layernorm(norm, mods)
    preprocess_linear_fusion(mods, resmooth_only=True)
    fuse_prequant_layernorm(norm, mods)
    assert [get_quantization_format(m) for m in mods] == ["nvfp4_awq"] * 2
    with pytest.raises(ValueError, match="pre_quant_scale"):
        fuse_prequant_layernorm(norm, [attach_quantizers(nn.Linear(64, 8), "fp8")])


def test_preprocess_linear_fusion_resmooths_to_the_mean_scale():
    scales = [_positive(64, s) for s in (1, 2, 3)]
    mods = _awq_projections(scales)
    x = _randn(6, 64, seed=4)
    for m in mods:
        m.weight_quantizer.disable()
    before = [m(x) for m in mods]
    preprocess_linear_fusion(mods)
    mean = torch.stack(scales).mean(dim=0)
    for m, ref in zip(mods, before):
        assert torch.equal(m.input_quantizer.pre_quant_scale, mean)
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)  # the float product, as above
        assert torch.equal(m.weight_quantizer.amax, m.weight_quantizer.amax_of(m.weight))  # recalibrated


def test_preprocess_linear_fusion_shares_per_tensor_amax_for_one_gemm():
    mods = [attach_quantizers(nn.Linear(64, 16), "fp8") for _ in range(3)]
    with torch.no_grad():
        mods[1].weight.mul_(4)  # a different weight range
    for m in mods:
        m.weight_quantizer.collect(m.weight)
    x = _randn(5, 64, seed=1)
    with calibrating(nn.ModuleList(mods)):
        for i, m in enumerate(mods):
            m(x * (i + 1))  # different input ranges

    def fused():
        fq = torch.ops.workbench.torch_fake_quant_fp8
        w = torch.cat([m.weight for m in mods])
        a_in = torch.stack([m.input_quantizer.amax for m in mods]).max()
        a_w = torch.stack([m.weight_quantizer.amax for m in mods]).max()
        return F.linear(fq(x, a_in), fq(w, a_w), torch.cat([m.bias for m in mods]))

    separate = lambda: torch.cat([m(x) for m in mods], dim=-1)  # noqa: E731
    assert not torch.allclose(fused(), separate(), rtol=1e-3, atol=1e-4)  # own scales: not one GEMM
    preprocess_linear_fusion(mods, resmooth_only=True)
    assert not all_items_same([m.weight_quantizer.amax for m in mods])
    preprocess_linear_fusion(mods)
    assert all_items_same([m.weight_quantizer.amax for m in mods])
    assert all_items_same([m.input_quantizer.amax for m in mods])
    # identical scales elementwise -> only GEMM summation order may differ
    torch.testing.assert_close(fused(), separate(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="share a quantization format"):
        preprocess_linear_fusion([mods[0], attach_quantizers(nn.Linear(64, 16), "nvfp4")])


def test_preprocess_linear_fusion_w4a8_shares_the_fp8_stage():
    mods = [attach_quantizers(nn.Linear(64, 8), "w4a8_awq", block_size=32) for _ in range(2)]
    with torch.no_grad():
        mods[0].weight.mul_(3)
    for m in mods:
        m.weight_quantizer.collect(m.weight)
    int4_before = [m.weight_quantizer[0].amax.clone() for m in mods]
    preprocess_linear_fusion(mods)
    assert mods[0].weight_quantizer[1].amax == mods[1].weight_quantizer[1].amax == mods[0].weight.abs().max()
    assert all(torch.equal(m.weight_quantizer[0].amax, a) for m, a in zip(mods, int4_before))  # per group: kept


def test_adjust_attn_amax_values_on_llama_attention():
    attn = _tiny_llama("fp8").model.layers[0].self_attn
    o_amax = attn.o_proj.weight_quantizer.amax.clone()
    expected = max(float(getattr(attn, p).weight.detach().abs().max()) for p in ("q_proj", "k_proj", "v_proj"))
    adjust_attn_amax_values(attn)
    for p in ("q_proj", "k_proj", "v_proj"):
        assert float(getattr(attn, p).weight_quantizer.amax) == expected
    assert torch.equal(attn.o_proj.weight_quantizer.amax, o_amax)
    only_o = nn.Module()
    only_o.o_proj = attn.o_proj
    with pytest.raises(ValueError, match="no q/k/v projection"):
        adjust_attn_amax_values(only_o)
    grouped = nn.Module()
    grouped.q_proj = attach_quantizers(nn.Linear(64, 8), "int4_awq", block_size=32)
    with pytest.raises(ValueError, match="per-tensor"):
        adjust_attn_amax_values(grouped)


def test_all_items_same():
    assert all_items_same(["fp8", "fp8"]) and all_items_same([None, None]) and all_items_same([])
    assert not all_items_same(["fp8", None])
    assert all_items_same([torch.ones(3), torch.ones(3)]) and not all_items_same([torch.ones(3), torch.zeros(3)])
    assert not all_items_same([torch.ones(3), 1.0])
