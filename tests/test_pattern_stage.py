"""The whole pattern_matcher stage on every tiny architecture: match counts, what must be gone,
layouts, numerics against HF eager, another shape, and toggling each transform off."""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.models import list_tiny_archs
from workbench.models.export_contract import make_batch
from workbench.pipeline.interface import Stages
from workbench.pipeline.transforms.caches.inputs import CAPTURE_KEY

wb_ops = torch.ops.workbench
LAST = "detect_hidden_states_for_capture"
MOE = {"mixtral", "qwen3_moe"}
# arch -> expected canonical op counts after the stage (2 layers, 4 q / 2 kv heads).
EXPECTED = {
    "llama": {"rmsnorm": 5, "swiglu": 2},
    "mistral": {"rmsnorm": 5, "swiglu": 2},
    "qwen2": {"rmsnorm": 5, "swiglu": 2},
    "qwen3": {"rmsnorm": 9, "swiglu": 2},  # + q_norm / k_norm per layer
    "mixtral": {"rmsnorm": 5, "moe_fused": 2, "topk_softmax": 2},
    "qwen3_moe": {"rmsnorm": 9, "moe_fused": 2, "topk_softmax": 2},
}
TOL = 1e-5


def _ops(gm, suffix):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).endswith(suffix)]


def _stage_keys(wb):
    return [e.key for e in wb.entries if e.config.stage == Stages.PATTERN_MATCHER]


def assert_canonical(gm, arch, attn_layout="bsnd"):
    exp = EXPECTED[arch]
    attn = _ops(gm, "torch_attention.default")
    assert len(attn) == 2 and all(n.kwargs["layout"] == attn_layout for n in attn)
    assert all(n.kwargs.get("is_causal") and n.kwargs.get("attn_mask") is None for n in attn)
    assert len(_ops(gm, "torch_rope_with_explicit_cos_sin.default")) == 2
    assert len(_ops(gm, "torch_rmsnorm.default")) == exp["rmsnorm"]
    assert len(_ops(gm, "torch_swiglu_mlp.default")) == exp.get("swiglu", 0)
    assert len(_ops(gm, "torch_moe_fused.default")) == exp.get("moe_fused", 0)
    assert len(_ops(gm, "torch_moe_topk_softmax.default")) == exp.get("topk_softmax", 0)
    for gone in ("scaled_dot_product_attention.default", "torch_attention_repeat_kv.default",
                 "aten.expand.default", "aten.transpose.int", "grouped_mm_fallback.default"):
        assert not _ops(gm, gone), gone


# the plain-attention families with their counts above; the others (SSM, conv, delta-rule, MLA,
# mRoPE, attention variants) are checked by their own tests
@pytest.fixture(scope="module", params=[a for a in list_tiny_archs() if a in EXPECTED])
def staged(request):
    wb = Workbench(f"tiny:{request.param}")
    wb.run_to(LAST)
    return request.param, wb


def test_stage_on_tiny_arch(staged):
    arch, wb = staged
    gm = wb.module
    assert_canonical(gm, arch)
    for snap in wb.snapshots:
        assert snap.numerics.ok and snap.numerics.rmse_ratio <= TOL, (snap.key, snap.numerics)
    # Another batch/sequence size against HF eager.
    batch = make_batch(wb.ctx.vocab_size, 3, 11, seed=7)
    with torch.no_grad():
        ref = wb.loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits
        out = wb.forward(*batch.args)  # before load_weights: weights bound by name
    rmse = (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert rmse <= TOL
    # Matches as reported by the snapshots.
    reported = {s.key: s.info.num_matches for s in wb.snapshots}
    assert reported["match_sdpa_to_torch_attention"] == 2 and reported["match_rope_pattern"] == 2
    assert reported["match_moe_pattern"] == (2 if arch in MOE else 0)
    # the canonical graph still exports (it is meta-traced until load_weights: meta inputs)
    torch.export.export(gm, tuple(a.to("meta") for a in batch.args), strict=False)


def _toggle_cases():
    dense = ["match_repeat_kv", "match_eager_attention", "match_sdpa_to_torch_attention",
             "match_grouped_attention", "match_attention_layout", "match_rope_pattern",
             "match_rope_layout", "match_rmsnorm_pattern", "match_l2norm_pattern",
             "eliminate_redundant_transposes", "match_swiglu_pattern"]
    moe = ["match_moe_pattern", "match_dense_moe_pattern", "match_bmm_moe_pattern",
           "match_moe_routing_pattern"]
    return [("llama", k) for k in dense] + [("mixtral", k) for k in moe]


@pytest.fixture(scope="module")
def toggled_benches():
    benches = {}
    for arch in ("llama", "mixtral"):
        wb = Workbench(f"tiny:{arch}")
        wb.run_to(LAST)
        benches[arch] = wb
    return benches


@pytest.mark.parametrize("arch,key", _toggle_cases())
def test_toggling_one_transform_off_keeps_logits(toggled_benches, arch, key):
    wb = toggled_benches[arch]
    wb.configure(key, enabled=False)
    try:
        wb.run_to(LAST)
        assert wb.snapshot(key).info.skipped
        final = wb.snapshots[-1].numerics
        assert final.ok and final.rmse_ratio <= TOL, final
    finally:
        wb.configure(key, enabled=True)


# The quantization keys change only quantized checkpoints (tests/test_quantize_transforms.py); on these
# unquantized models each reports 0 matches with the reason.
QUANT_KEYS = {
    "quantize_fp8_linear_from_config", "quantize_fp8_bmm_from_config", "quantize_fp8_from_graph",
    "quantize_fp8_moe", "quantize_finegrained_fp8_linear_from_config", "quantize_finegrained_fp8_moe",
    "quantize_int4_linear_from_config", "quantize_int4_gptq_linear_from_config",
    "quantize_nvfp4_linear_from_config", "quantize_nvfp4_from_graph", "quantize_nvfp4_moe",
    "quantize_mxfp4_moe", "match_nvfp4_swiglu_pattern", "match_finegrained_fp8_swiglu_pattern",
}


def test_toggle_defaults_cover_every_stage_transform(toggled_benches):
    wb = toggled_benches["llama"]
    wb.run_to(LAST)  # the toggle tests re-configure it, which drops the snapshots after their key
    keys = set(_stage_keys(wb))
    covered = {k for _, k in _toggle_cases()} | {"split_moe_fused_for_sharding", LAST} | QUANT_KEYS
    assert keys == covered
    for key in QUANT_KEYS:
        info = wb.snapshot(key).info
        assert info.num_matches == 0 and (info.skip_reason or info.details), (key, info)


def test_split_and_triton_routing_and_bnsd_layout_options():
    wb = Workbench("tiny:mixtral")
    wb.configure("split_moe_fused_for_sharding", enabled=True)
    wb.configure("match_moe_routing_pattern", backend="triton")
    wb.configure("match_attention_layout", attn_layout="bnsd")
    wb.configure("match_rope_layout", expected_layout="bnsd")
    wb.run_to(LAST)
    gm = wb.module
    assert len(_ops(gm, "torch_moe.default")) == 2 and not _ops(gm, "torch_moe_fused.default")
    assert len(_ops(gm, "triton_moe_topk_softmax.default")) == 2
    assert all(n.kwargs.get("layout", "bnsd") == "bnsd" for n in _ops(gm, "torch_attention.default"))
    assert wb.snapshots[-1].numerics.rmse_ratio <= TOL
    assert not wb.snapshot("split_moe_fused_for_sharding").mem_warning  # views, no copies


def test_detect_hidden_states_for_capture():
    wb = Workbench("tiny:llama")
    wb.configure(LAST, eagle3_layers_to_capture={0, 1})
    wb.run_to(LAST)
    snap = wb.snapshots[-1]
    assert snap.info.num_matches == 2
    marked = {n.meta[CAPTURE_KEY]: n for n in wb.module.graph.nodes if CAPTURE_KEY in n.meta}
    assert sorted(marked) == [0, 1]
    assert all(n.target is torch.ops.aten.add.Tensor for n in marked.values())  # residual adds
    assert wb.ctx.hidden_states_to_capture == {i: n.name for i, n in marked.items()}
    wb.configure(LAST, eagle3_layers_to_capture={5})
    with pytest.raises(Exception, match="not found"):
        wb.run_to(LAST)
