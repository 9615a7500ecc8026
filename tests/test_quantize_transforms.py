"""The 14 quantization transforms: match counts on graphs of the project's tiny quantized checkpoints,
excluded modules left alone, 0 matches with the reason elsewhere, quant-config reading, config
validation, the at-load conversions, FP8 BMM on a graph of our own and the fake-quant (from-graph)
path on a model with quantizers attached.

Numerics here are of the pattern-stage graph (bound by name before ``load_weights``) against the
dequantized twin: weight-only formats compute the same products from the same dequantized weights
(only fp32 summation order differs: <= 1e-5 relative RMSE); activation-quantizing formats are
bounded in ``test_quantized_checkpoints.py``, which runs the whole pipeline.
"""

from __future__ import annotations

import json

import pytest
import torch

from workbench import Workbench
from workbench.models import load_model
from workbench.models.export_contract import make_batch
from workbench.models.quantized_checkpoint import QuantizedCheckpoint
from workbench.models.tiny_quantized import save_tiny_quantized
from workbench.ops.quant import codecs
from workbench.pipeline.config import ConfigError, resolve_pipeline
from workbench.pipeline.context import PipelineContext
from workbench.pipeline.interface import TRANSFORMS, GraphState, Stages
from workbench.pipeline.weight_placement import place_weights
from workbench.pipeline.weights import WeightSource, tensor_bindings
from workbench.quantization.checkpoint_config import QuantConfig, read_quant_config, write_quant_config

ONE_THREAD = True  # see conftest.one_thread
LAST = "detect_hidden_states_for_capture"
KEYS = (
    "quantize_int4_linear_from_config", "quantize_int4_gptq_linear_from_config", "quantize_fp8_linear_from_config",
    "quantize_nvfp4_linear_from_config", "quantize_finegrained_fp8_linear_from_config", "quantize_finegrained_fp8_moe",
    "quantize_fp8_bmm_from_config", "quantize_fp8_from_graph", "quantize_nvfp4_from_graph",
    "match_nvfp4_swiglu_pattern", "match_finegrained_fp8_swiglu_pattern", "quantize_fp8_moe", "quantize_nvfp4_moe",
    "quantize_mxfp4_moe",
)
# (arch, format, save options) -> matches per key (every other key: 0). tiny:llama has 2 layers x 7
# linears + a tied LM head (excluded); tiny:qwen3_moe 2 x 4 attention linears, a router (excluded)
# and a MoE block per layer.
CASES = {
    ("llama", "FP8", ()): {"quantize_fp8_linear_from_config": 14},
    ("llama", "FP8_BLOCK", (("block", (32, 32)),)): {"quantize_finegrained_fp8_linear_from_config": 14,
                                                     "match_finegrained_fp8_swiglu_pattern": 2},
    ("llama", "NVFP4", ()): {"quantize_nvfp4_linear_from_config": 14, "match_nvfp4_swiglu_pattern": 2},
    ("llama", "W4A16_AWQ", ()): {"quantize_int4_linear_from_config": 14},
    ("llama", "W4A16_GPTQ", (("desc_act", True),)): {"quantize_int4_gptq_linear_from_config": 14},
    ("qwen3_moe", "FP8", ()): {"quantize_fp8_linear_from_config": 8, "quantize_fp8_moe": 2},
    ("qwen3_moe", "FP8_BLOCK", ()): {"quantize_finegrained_fp8_linear_from_config": 8,
                                     "quantize_finegrained_fp8_moe": 2},
    ("qwen3_moe", "NVFP4", ()): {"quantize_nvfp4_linear_from_config": 8, "quantize_nvfp4_moe": 2},
    ("qwen3_moe", "MXFP4", ()): {"quantize_mxfp4_moe": 2},
}
WEIGHT_ONLY = {"W4A16_AWQ", "W4A16_GPTQ", "MXFP4"}


def _ops(gm, suffix):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).endswith(suffix)]


def _rmse(out, ref):
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.fixture(scope="module", params=list(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def staged(request, tmp_path_factory):
    arch, fmt, options = request.param
    directory = save_tiny_quantized(arch, fmt, tmp_path_factory.mktemp(f"{arch}_{fmt}"), **dict(options))
    wb = Workbench(str(directory), numerics=False)
    wb.run_to(LAST)
    return request.param, wb


def test_match_counts_per_key(staged):
    (arch, fmt, _), wb = staged
    expected = CASES[staged[0]]
    reported = {s.key: s.info.num_matches for s in wb.snapshots if s.key in KEYS}
    assert set(reported) == set(KEYS)
    assert reported == {k: expected.get(k, 0) for k in KEYS}
    for key, n in reported.items():  # every key that did nothing says why
        assert n or wb.snapshot(key).info.skip_reason, key
    gm = wb.module
    assert not _ops(gm, "torch_moe_fused.default")  # every MoE block went quantized
    linears = _ops(gm, "aten.linear.default")
    # left in full precision: the tied LM head (llama), or the LM head and the routers (qwen3_moe);
    # MXFP4 keeps attention unquantized too (gpt-oss style)
    assert len(linears) == {"llama": 1, "qwen3_moe": 3 + (8 if fmt == "MXFP4" else 0)}[arch]


def test_pattern_stage_numerics_against_dequantized_twin(staged):
    (arch, fmt, _), wb = staged
    batch = make_batch(wb.ctx.vocab_size, 2, 7, seed=3)
    with torch.no_grad():
        ref = wb.loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits
        out = wb.forward(*batch.args)  # before load_weights: quantized tensors bound by name
    # weight-only: the same dequantized weights, fp32 summation order apart; W8A8 / W4A4 formats
    # round the activations too (bounded end to end in test_quantized_checkpoints.py): FP4 activations
    # lose about half the logits' RMS through the gain of the tiny models' init (models/tiny.py)
    assert _rmse(out, ref) <= (1e-5 if fmt in WEIGHT_ONLY else 0.8 if fmt == "NVFP4" else 0.25)


def test_graph_tensors_are_checkpoint_names_with_declared_bindings(staged):
    (arch, fmt, _), wb = staged
    gm = wb.module
    bindings = tensor_bindings(gm)
    ck = wb.ctx.checkpoint
    assert bindings and all(t.startswith("model.") for t in bindings)
    for target, binding in bindings.items():
        assert all(name in ck for name in binding.inputs), (target, binding)
        assert binding.namespace == "checkpoint"
    if arch == "llama":  # per-module names as the checkpoint has them, e.g. q_proj.weight_scale
        names = {t.rsplit(".", 1)[-1] for t in bindings}
        want = {"FP8": {"weight", "weight_scale", "input_scale"}, "FP8_BLOCK": {"weight", "weight_scale_inv"},
                "NVFP4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
                "W4A16_AWQ": {"weight", "weight_scale", "weight_offsets", "pre_quant_scale"},
                "W4A16_GPTQ": {"qweight", "qzeros", "scales", "g_idx"}}[fmt]
        assert names == want
    if fmt == "W4A16_AWQ":  # ModelOpt's row-paired packing is converted for our op at load
        awq = bindings["model.model.layers.0.self_attn.q_proj.weight"]
        assert awq.convert is not None and awq.convert.__name__ == "awq_weight_for_op"


@pytest.fixture(scope="module")
def unquantized():
    wb = Workbench("tiny:llama", numerics=False)
    wb.run_to(LAST)
    return wb


def test_unquantized_model_reports_zero_matches_with_reasons(unquantized):
    for key in KEYS:
        info = unquantized.snapshot(key).info
        assert info.num_matches == 0 and not info.skipped, key
        assert info.skip_reason, key
    for key in KEYS[:7] + KEYS[11:]:
        assert "no quantization config" in unquantized.snapshot(key).info.skip_reason, key
    assert "torch_fake_quant_fp8" in unquantized.snapshot("quantize_fp8_from_graph").info.skip_reason
    assert "torch_nvfp4_linear" in unquantized.snapshot("match_nvfp4_swiglu_pattern").info.skip_reason
    assert len(_ops(unquantized.module, "torch_swiglu_mlp.default")) == 2  # the unquantized MLP matched as before


def test_other_format_reports_which_it_is(staged):
    (arch, fmt, _), wb = staged
    other = "quantize_int4_gptq_linear_from_config" if fmt != "W4A16_GPTQ" else "quantize_fp8_linear_from_config"
    reason = wb.snapshot(other).info.skip_reason
    assert f"the checkpoint is {fmt}" in reason


def test_excluded_modules_stay_full_precision(tmp_path):
    """Exclusions from the checkpoint's config (stored unquantized) and from the transform's config
    (stored quantized, run on the dequantized twin) both leave aten.linear in place."""
    directory = save_tiny_quantized("llama", "FP8", tmp_path, exclude=("lm_head", "model.layers.0.self_attn.o_proj"))
    assert read_quant_config(directory).is_excluded("model.layers.0.self_attn.o_proj")
    wb = Workbench(str(directory), numerics=False)
    wb.configure("quantize_fp8_linear_from_config", exclude_modules=["model.layers.1.mlp.*"])
    wb.run_to("load_weights")
    info = wb.snapshot("quantize_fp8_linear_from_config").info
    assert info.num_matches == 14 - 1 - 3
    assert set(info.details["excluded"]) == {"lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
                                             "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"}
    gm = wb.module
    full = {n.args[1].target for n in _ops(gm, "aten.linear.default")}
    assert full == {"model.lm_head.weight", "model.model.layers.0.self_attn.o_proj.weight"}
    # the unquantized MLP of layer 1 is what match_swiglu_pattern (after the quantize keys) matches
    (mlp,) = _ops(gm, "torch_swiglu_mlp.default")
    assert [a.target for a in mlp.args[1:4]] == [f"model.model.layers.1.mlp.{p}.weight"
                                                 for p in ("gate_proj", "up_proj", "down_proj")]
    # the twin's fp32 weights are what they read; the quantized ones are fp8 from the checkpoint
    twin = dict(wb.loaded.model.named_parameters())
    assert gm.get_parameter("model.model.layers.1.mlp.down_proj.weight") is twin["model.layers.1.mlp.down_proj.weight"]
    assert gm.get_buffer("model.model.layers.1.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------ quant config


def test_quant_config_roundtrip_and_hf_spellings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for cfg in (QuantConfig("FP8", exclude_modules=("lm_head",), kv_cache_quant_algo="FP8"),
                QuantConfig("NVFP4", group_size=16), QuantConfig("W4A16_AWQ", group_size=64, sym=True),
                QuantConfig("FP8_BLOCK", weight_block_size=(128, 128), exclude_modules=("gate", "lm_head")),
                QuantConfig("W4A16_GPTQ", group_size=32, desc_act=True), QuantConfig("MXFP4", group_size=32)):
        for f in ("hf_quant_config.json",):
            (tmp_path / f).unlink(missing_ok=True)
        path = write_quant_config(tmp_path, cfg)
        back = read_quant_config(tmp_path)
        assert back == cfg and back.source.startswith(path.name), (cfg, back)
    hf = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "modules_to_not_convert": ["gate", "lm_head"], "ignore": ["model.layers.0.*"]}}
    cfg = read_quant_config(hf_config=hf)
    assert (cfg.quant_algo, cfg.weight_block_size, cfg.exclude_modules) == (
        "FP8_BLOCK", (128, 128), ("gate", "lm_head", "model.layers.0.*"))
    # short names match as dotted components, wildcards as fnmatch on the module or a parent of it
    assert cfg.is_excluded("model.layers.3.mlp.gate") and not cfg.is_excluded("model.layers.3.mlp.gate_proj")
    assert cfg.is_excluded("model.layers.0.self_attn.q_proj") and not cfg.is_excluded("model.layers.1.self_attn.q_proj")
    gptq = read_quant_config(hf_config={"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                                "desc_act": True, "sym": False}})
    assert (gptq.quant_algo, gptq.group_size, gptq.desc_act, gptq.sym) == ("W4A16_GPTQ", 128, True, False)
    nested = read_quant_config(hf_config={"quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                     "exclude_modules": ["lm_head"]}}})
    assert (nested.quant_algo, nested.group_size, nested.exclude_modules) == ("NVFP4", 16, ("lm_head",))
    assert read_quant_config(hf_config={"model_type": "llama"}) is None


@pytest.mark.parametrize("bad,match", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 8}}, "only 4 is supported"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "INT3"}}, "quant_algo 'INT3'"),
    ({"quantization_config": {"quant_method": "awq", "group_size": "big"}}, "group_size must be an integer"),
])
def test_quant_config_errors_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        read_quant_config(hf_config=bad)


def test_quant_config_file_errors(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_quant_config(tmp_path)
    with pytest.raises(ValueError, match="needs weight_block_size"):
        QuantConfig("FP8_BLOCK")
    with pytest.raises(ValueError, match="config.json"):
        write_quant_config(tmp_path / "missing", QuantConfig("MXFP4"))


def test_transform_config_validation():
    with pytest.raises(ConfigError, match="quantize_unquantized"):  # GPTQ cannot quantize at load
        resolve_pipeline(overrides={"quantize_int4_gptq_linear_from_config.quantize_unquantized": True})
    with pytest.raises(ConfigError, match="exclude_modules"):
        resolve_pipeline(overrides={"quantize_fp8_linear_from_config.exclude_modules": 3})
    entries = resolve_pipeline(overrides={"quantize_nvfp4_moe.exclude_modules": ["model.layers.0.*"]})
    keys = [e.key for e in entries]
    assert all(keys.index(k) < keys.index(LAST) for k in KEYS)
    assert keys.index("match_swiglu_pattern") < keys.index("match_nvfp4_swiglu_pattern")
    assert keys.index("match_moe_pattern") < keys.index("quantize_fp8_moe")
    assert all(e.config.stage == Stages.PATTERN_MATCHER for e in entries if e.key in KEYS)


# ------------------------------------------------------------------------------ conversions


def test_fp8_gate_up_stacking_requantizes_only_when_scales_differ():
    from workbench.pipeline.transforms.quantization.moe import stack_fp8_gate_up

    g = torch.randn(2, 6, 8)
    u = torch.randn(2, 6, 8) * 3
    shared = torch.maximum(g.abs().amax(), u.abs().amax()) / codecs.FP8_E4M3_MAX
    gw = [codecs.to_fp8(g[e], shared) for e in range(2)]
    uw = [codecs.to_fp8(u[e], shared) for e in range(2)]
    one = torch.tensor(1.0)
    w, s, i = stack_fp8_gate_up(*gw, *uw, shared, shared, shared, shared, one, one * 2, one * 3, one, experts=2)
    assert torch.equal(w.view(torch.uint8), torch.stack([torch.cat([a, b]) for a, b in zip(gw, uw)]).view(torch.uint8))
    assert torch.equal(s, shared.expand(2)) and torch.equal(i, torch.tensor([3.0, 2.0]))
    # gate with its own (smaller) scale: requantized to the shared one, within one fp8 rounding
    g_own = [codecs.fp8_per_tensor_quantize(g[e]) for e in range(2)]
    w2, s2, _ = stack_fp8_gate_up(g_own[0][0], g_own[1][0], *uw, g_own[0][1], g_own[1][1], shared, shared,
                                  one, one, one, one, experts=2)
    assert torch.equal(s2, shared.expand(2))
    gate_back = w2[:, :6].float() * shared
    want = torch.stack([g_own[e][0].float() * g_own[e][1] for e in range(2)])
    # one e4m3 rounding: half an ulp (2^-4 relative), or half the subnormal step (2^-10 x scale)
    assert torch.allclose(gate_back, want, rtol=2 ** -4, atol=shared.item() * 2 ** -10)


def test_fp8_bmm_from_config_on_a_graph_of_our_own():
    from workbench.pipeline.matcher import export_graph_module
    from workbench.pipeline.transforms.quantization.bmm import bmm_scale_names

    class Bmm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Module()
            self.proj.weight = torch.nn.Parameter(torch.randn(3, 16, 8), requires_grad=False)

        def forward(self, x):
            return torch.bmm(x, self.proj.weight)

    mod = Bmm()
    x = torch.randn(3, 5, 16)
    w8, ws = codecs.fp8_per_tensor_quantize(mod.proj.weight)
    xs = x.abs().amax() / codecs.FP8_E4M3_MAX
    assert bmm_scale_names("proj.weight") == ("proj.weight_scale", "proj.input_scale")
    ck = QuantizedCheckpoint(QuantConfig("FP8"), {"proj.weight": w8, "proj.weight_scale": ws.reshape(1),
                                                  "proj.input_scale": xs.reshape(1)})
    gm = export_graph_module(mod, (x,))
    ctx = PipelineContext.standalone(checkpoint=ck)
    transform = TRANSFORMS.get("quantize_fp8_bmm_from_config")(
        TRANSFORMS.get("quantize_fp8_bmm_from_config").config_class(stage="pattern_matcher"))
    gm, info, _ = transform(gm, ctx, GraphState())
    assert info.num_matches == 1 and len(_ops(gm, "torch_fp8_bmm.default")) == 1
    # exported modules keep the names as they are (no "model." prefix): bound straight from the checkpoint
    place_weights(gm, WeightSource(mod, ck.tensors), torch.device("cpu"))
    assert gm.get_buffer("proj.weight").dtype == torch.float8_e4m3fn
    ref = torch.ops.workbench.torch_fp8_bmm(x, w8, xs, ws)
    assert torch.equal(gm(x), ref)
    # another format's checkpoint: nothing to do, and it says why
    ctx = PipelineContext.standalone(checkpoint=QuantizedCheckpoint(QuantConfig("NVFP4"), {}))
    _, info, _ = transform(export_graph_module(mod, (x,)), ctx, GraphState())
    assert info.num_matches == 0 and "the checkpoint is NVFP4" in info.skip_reason


def test_quantize_at_load_fp8_of_an_unquantized_model():
    wb = Workbench("tiny:llama", numerics=False)
    wb.configure("quantize_fp8_linear_from_config", quantize_unquantized=True)
    wb.run_to("load_weights")
    info = wb.snapshot("quantize_fp8_linear_from_config").info
    assert info.num_matches == 14 and len(info.details["quantized_at_load"]) == 14
    assert info.details["tied"] == ["lm_head"]  # the tied LM head is the embedding too: left alone
    gm = wb.module
    w = gm.get_buffer("model.model.layers.0.mlp.up_proj.weight")
    ref_w, ref_s = codecs.fp8_per_tensor_quantize(wb.loaded.model.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(w.view(torch.uint8), ref_w.view(torch.uint8))
    assert torch.equal(gm.get_buffer("model.model.layers.0.mlp.up_proj.weight_scale"), ref_s)
    assert gm.get_buffer("model.model.layers.0.mlp.up_proj.input_scale").item() == 1.0


@pytest.mark.parametrize("fmt,op,key", [("fp8", "torch_fp8_linear.default", "quantize_fp8_from_graph"),
                                        ("nvfp4", "torch_nvfp4_linear.default", "quantize_nvfp4_from_graph")])
def test_from_graph_folds_fake_quant_linears(fmt, op, key):
    from workbench.quantization.quant_modules import calibrating, quantize_linears

    loaded = load_model("tiny:llama")
    names = quantize_linears(loaded.model, fmt)
    with calibrating(loaded.model):
        loaded.model(input_ids=torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0)))
    wb = Workbench(loaded, numerics=False)
    wb.run_to(LAST)
    info = wb.snapshot(key).info
    assert len(names) == 14 and info.num_matches == 14 and info.details["amax_dropped"] == 28
    gm = wb.module
    assert not _ops(gm, "torch_fake_quant_fp8.default") and not _ops(gm, "torch_fake_quant_nvfp4.default")
    assert len(_ops(gm, op)) + 3 * len(_ops(gm, "swiglu_mlp.default")) == 14
    assert all(b.namespace == "model" for b in tensor_bindings(gm).values())  # quantized at load from the model
    batch = make_batch(512, 2, 9, seed=5)
    with torch.no_grad():
        ref = loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits  # the fake-quant model
        out = wb.forward(*batch.args)
    # the real ops compute what the fake-quant nodes did (same codecs, same scales)
    assert _rmse(out, ref) <= 1e-5
