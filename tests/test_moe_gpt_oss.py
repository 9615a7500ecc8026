"""gpt-oss's MoE on the canonical MoE op, and its MXFP4 checkpoint on the MXFP4 MoE op.

gpt-oss's experts (``GptOssExperts``) differ from the Mixtral-like ones ``match_moe_pattern`` always
knew: weights stored ``[E, in, out]``, per-expert biases, gate/up rows interleaved, and a clamped
SwiGLU ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``. They reach
``torch_moe_fused`` with its bias / layout / activation options (``ops/moe/expert_mlp.py``):

* the op equals HF's own eager experts loop, and its MXFP4 twin equals it on dequantized weights;
* after the pattern stage, each export form (``grouped_mm``, ``batched_mm``, grouped with the
  expert-parallel sentinel) is one ``torch_moe_fused`` per layer, nothing of transformers' experts
  left, logits as HF's; rewrites that cannot carry the options (split for sharding, FP8 MoE) leave the
  node alone and say why;
* the whole default pipeline then greedy-decodes 16 tokens equal to HF ``generate``;
* ``save_tiny_quantized("gpt_oss", "MXFP4")`` writes gpt-oss's layout (``[E, out, in/32, 16]`` blocks,
  interleaved rows, biases kept), and the pipeline on it ends with ``torch_mxfp4_moe`` (biases bound)
  and HF's tokens on the dequantized twin;
* ``quantize_mxfp4_moe`` takes the reference's ``backend`` / ``trtllm_quant_act`` and reports the
  kernel that runs (the torch reference) and why.

The other registry MoE families already reached ``torch_moe_fused`` before (or are custom models
that emit it), so gpt-oss is the only one counted here.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest
import torch
from pydantic import ValidationError
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model, quantized_checkpoint
from workbench.models.export_contract import make_batch
from workbench.models.tiny_quantized import save_tiny_quantized
from workbench.ops.quant import codecs
from workbench.pipeline.interface import TRANSFORMS, Stages
from workbench.pipeline.transforms.quantization.moe_mxfp4 import resolve_mxfp4_kernel

wb_ops = torch.ops.workbench
LAST = "detect_hidden_states_for_capture"  # the pattern stage's last transform
PROMPTS = [[1, 2, 3, 4, 5], [7, 300, 11]]
NEW = 16
LAYERS = 2
TOL = 1e-5


@contextmanager
def _warnings(logger="workbench.pipeline"):
    """The warning messages ``logger`` emits within the block (the suite runs with -p no:logging)."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, log = Keep(logging.WARNING), logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


def _nodes(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def _names(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _gpt_oss_experts(seed=0, experts=4, hidden=16, inter=8):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"  # HF's reference loop over the experts
    torch.manual_seed(seed)
    mod = GptOssExperts(cfg).eval()
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=1.0)  # large enough that both clamps bite
    return mod


# ------------------------------------------------------------------------------ the ops


def test_fused_op_with_gpt_oss_options_equals_hf_experts():
    mod = _gpt_oss_experts()
    x = torch.randn(9, 16)
    sel = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    w = torch.softmax(torch.randn(9, 2), dim=-1)
    with torch.no_grad():
        ref = mod(x, sel, w)
        out = wb_ops.torch_moe_fused(
            x, sel, w, mod.gate_up_proj.transpose(1, 2), mod.down_proj.transpose(1, 2), act_fn="clamped_swiglu",
            w1_w3_bias=mod.gate_up_proj_bias, w2_bias=mod.down_proj_bias, gate_up_interleaved=True,
            swiglu_alpha=mod.alpha, swiglu_limit=mod.limit,
        )
        h = torch.einsum("th,ehj->etj", x, mod.gate_up_proj) + mod.gate_up_proj_bias[:, None]
    assert h[..., ::2].max() > mod.limit and h[..., 1::2].min() < -mod.limit  # both clamps bite
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # without the options the op is a different function: they are not ignored
    plain = wb_ops.torch_moe_fused(x, sel, w, mod.gate_up_proj.transpose(1, 2), mod.down_proj.transpose(1, 2))
    assert (plain - ref).abs().max() > 1e-2
    torch.library.opcheck(
        wb_ops.torch_moe_fused.default,
        (x, sel, w, mod.gate_up_proj.detach().transpose(1, 2), mod.down_proj.detach().transpose(1, 2)),
        {"act_fn": "clamped_swiglu", "w1_w3_bias": mod.gate_up_proj_bias.detach(),
         "w2_bias": mod.down_proj_bias.detach(), "gate_up_interleaved": True},
        test_utils=("test_schema", "test_faketensor"),
    )


def test_mxfp4_op_with_gpt_oss_options_equals_fused_op_on_dequantized_weights():
    mod = _gpt_oss_experts(hidden=64, inter=32)  # MXFP4 blocks of 32 along the inputs
    x = torch.randn(7, 64)
    sel = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    w = torch.softmax(torch.randn(7, 2), dim=-1)
    packed, deq = [], []
    for p in (mod.gate_up_proj, mod.down_proj):  # stored [E, out, in] as gpt-oss checkpoints have them
        blocks, scales = codecs.mxfp4_quantize(p.detach().transpose(1, 2).contiguous(), 32)
        packed.append((blocks, scales))
        deq.append(codecs.mxfp4_dequantize(blocks, scales, 32))
    opts = dict(act_fn="clamped_swiglu", gate_up_interleaved=True, swiglu_alpha=mod.alpha, swiglu_limit=mod.limit)
    with torch.no_grad():
        ref = wb_ops.torch_moe_fused(x, sel, w, deq[0], deq[1], w1_w3_bias=mod.gate_up_proj_bias,
                                     w2_bias=mod.down_proj_bias, **opts)
        out = wb_ops.torch_mxfp4_moe(x, sel, w, *packed[0], mod.gate_up_proj_bias, *packed[1], mod.down_proj_bias,
                                     **opts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the pattern stage


def _staged(impl=None, expert_parallel=False, **options):
    loaded = load_model("tiny:gpt_oss")
    if impl is not None:
        loaded.model.config._experts_implementation = impl
    for m in loaded.model.modules():
        if expert_parallel and hasattr(m, "_is_expert_parallel"):
            m._is_expert_parallel = True  # transformers 5.17 writes the sentinel mask always; 5.23 only then
    bench = Workbench(loaded, **options)
    return bench


@pytest.mark.parametrize(
    ("impl", "expert_parallel", "pattern"),
    [
        ("grouped_mm", False, "gpt_oss_grouped_mm"),
        ("batched_mm", False, "gpt_oss_batched_mm"),
        ("grouped_mm", True, "gpt_oss_grouped_mm_sentinel"),
    ],
)
def test_pattern_stage_reaches_torch_moe_fused(impl, expert_parallel, pattern):
    bench = _staged(impl, expert_parallel, numerics=False)  # one logits check below, not one per step
    bench.configure("split_moe_fused_for_sharding", enabled=True)  # it must leave these nodes alone
    bench.run_to(LAST)
    reported = {s.key: s.info for s in bench.snapshots}
    moe = reported["match_moe_pattern"]
    assert moe.num_matches == LAYERS and moe.details["matches"][pattern] == LAYERS, moe.details
    assert reported["match_dense_moe_pattern"].num_matches == 0
    assert reported["match_bmm_moe_pattern"].num_matches == 0
    split = reported["split_moe_fused_for_sharding"]
    assert split.num_matches == 0 and len(split.details["left"]) == LAYERS
    assert "expert biases, interleaved gate/up rows, act_fn='clamped_swiglu'" in split.details["left"][0]

    gm = bench.module
    nodes = _nodes(gm, wb_ops.torch_moe_fused.default)
    assert len(nodes) == LAYERS
    for n in nodes:
        assert n.args[5] == "clamped_swiglu" and n.args[8:] == (True, 1.702, 7.0)  # interleaved, alpha, limit
        assert [b.target.rsplit(".", 1)[-1] for b in n.args[6:8]] == ["gate_up_proj_bias", "down_proj_bias"]
        assert n.args[3].target is torch.ops.aten.transpose.int  # [E, H, 2I] read as [E, 2I, H]
    gone = {"transformers.grouped_mm_fallback.default", "aten.bmm.default", "aten.histc.default",
            "aten.sort.default", "aten.sigmoid.default"}
    assert not gone & _names(gm)
    batch = make_batch(bench.ctx.vocab_size, 2, 9, seed=7)
    with torch.no_grad():
        ref = bench.loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits
        out = bench.forward(*batch.args)
    rmse = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rmse <= TOL, rmse


def test_default_pipeline_generates_hf_greedy_tokens():
    loaded = load_model("tiny:gpt_oss")
    bench = Workbench(loaded, numerics=False)
    bench.run()
    assert len(_nodes(bench.module, wb_ops.torch_moe_fused.default)) == LAYERS
    out = bench.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    hf = [_hf_greedy(loaded.model, p, NEW) for p in PROMPTS]
    assert all(len(set(t)) >= 8 for t in hf)  # HF's tokens depend on the context: a strong oracle
    assert out.token_ids == hf


def test_fp8_moe_refuses_gpt_oss_experts_by_name(tmp_path):
    loaded = load_model(str(save_tiny_quantized("gpt_oss", "FP8", tmp_path)))
    bench = Workbench(loaded, numerics=False)
    bench.run_to(LAST)
    info = bench.snapshot("quantize_fp8_moe").info
    assert info.num_matches == 0 and len(info.details["left"]) == LAYERS
    assert "expert biases, interleaved gate/up rows, act_fn='clamped_swiglu' (workbench::torch_fp8_moe has none)" \
        in info.details["left"][0]
    assert len(_nodes(bench.module, wb_ops.torch_moe_fused.default)) == LAYERS  # left on the twin's weights


# ------------------------------------------------------------------------------ the MXFP4 checkpoint


def test_tiny_mxfp4_checkpoint_has_gpt_oss_layout(tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(str(save_tiny_quantized("gpt_oss", "MXFP4", tmp_path) / "model.safetensors"))
    model = load_model("tiny:gpt_oss").model  # the same seed: the weights that were quantized
    experts = model.model.layers[0].mlp.experts
    prefix = "model.layers.0.mlp.experts."
    e, h, two_i = experts.gate_up_proj.shape
    assert tensors[prefix + "gate_up_proj_blocks"].shape == (e, two_i, h // 32, 16)  # [E, out, in/32, 16]
    assert tensors[prefix + "gate_up_proj_scales"].shape == (e, two_i, h // 32)
    assert tensors[prefix + "down_proj_blocks"].shape == (e, h, two_i // 2 // 32, 16)
    assert prefix + "gate_up_proj" not in tensors and prefix + "down_proj" not in tensors  # no fp32 copy
    torch.testing.assert_close(tensors[prefix + "gate_up_proj_bias"], experts.gate_up_proj_bias.detach())
    torch.testing.assert_close(tensors[prefix + "down_proj_bias"], experts.down_proj_bias.detach())
    for name, param in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
        blocks = tensors[prefix + name + "_blocks"]
        deq = codecs.mxfp4_dequantize(blocks.reshape(*blocks.shape[:2], -1), tensors[prefix + name + "_scales"], 32)
        want = param.detach().transpose(1, 2)  # rows in the model's order: gate/up interleaved
        err = ((deq - want).norm() / want.norm()).item()
        assert err < 0.2, (name, err)  # MXFP4's rounding; the wrong orientation gives ~1.4


LOADER_ORIENTS = hasattr(quantized_checkpoint, "orient_transposed_experts")


@pytest.mark.skipif(
    not LOADER_ORIENTS,
    reason="needs models/quantized_checkpoint.py to turn MXFP4 experts that transformers keeps [E, in, out] "
    "(gpt-oss) when it dequantizes the twin (orient_transposed_experts; patch handed to the lead)",
)
def test_mxfp4_checkpoint_reaches_torch_mxfp4_moe_with_biases(tmp_path):
    loaded = load_model(str(save_tiny_quantized("gpt_oss", "MXFP4", tmp_path)))
    bench = Workbench(loaded, numerics=False, overrides={"quantize_mxfp4_moe.backend": "trtllm",
                                                         "quantize_mxfp4_moe.trtllm_quant_act": "bf16"})
    with _warnings() as warned:
        bench.run()
    info = bench.snapshot("quantize_mxfp4_moe").info
    assert info.num_matches == LAYERS and info.details["left"] == []
    assert info.details["kernel"] == "torch_mxfp4_moe (torch reference)"
    assert (info.details["backend_requested"], info.details["backend_resolved"]) == ("trtllm", "triton")
    assert info.details["trtllm_quant_act"] == "bf16"
    assert "falls back to triton" in info.details["kernel_notes"][0]
    assert any("falling back to triton" in m for m in warned)

    gm = bench.module
    assert not _nodes(gm, wb_ops.torch_moe_fused.default)
    nodes = _nodes(gm, wb_ops.torch_mxfp4_moe.default)
    assert len(nodes) == LAYERS
    for n in nodes:
        assert n.args[5] is not None and n.args[8] is not None  # w1_w3_bias, w2_bias bound
        assert (n.kwargs["act_fn"], n.kwargs["gate_up_interleaved"]) == ("clamped_swiglu", True)
    params = dict(gm.named_parameters())
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in params)  # fp32 gone
    out = bench.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert out.token_ids == [_hf_greedy(loaded.model, p, NEW) for p in PROMPTS]  # HF on the dequantized twin


# ------------------------------------------------------------------------------ the reference's fields


def _mxfp4_config(**fields):
    return TRANSFORMS.get("quantize_mxfp4_moe").config_class.model_validate({"stage": Stages.PATTERN_MATCHER, **fields})


def test_mxfp4_config_takes_the_reference_fields_and_rejects_others():
    assert (_mxfp4_config().backend, _mxfp4_config().trtllm_quant_act) == (None, "mxfp8")
    for backend in (None, "triton", "trtllm"):
        assert _mxfp4_config(backend=backend).backend == backend
    for act in ("bf16", "mxfp8"):
        assert _mxfp4_config(trtllm_quant_act=act).trtllm_quant_act == act
    with pytest.raises(ValidationError, match="backend\n  Input should be 'triton' or 'trtllm'"):
        _mxfp4_config(backend="cutlass")
    with pytest.raises(ValidationError, match="trtllm_quant_act\n  Input should be 'bf16' or 'mxfp8'"):
        _mxfp4_config(trtllm_quant_act="fp8")
    with pytest.raises(ValidationError, match="backends\n  Extra inputs are not permitted"):
        _mxfp4_config(backends="triton")


def test_mxfp4_kernel_resolution_says_what_runs():
    cpu = torch.device("cpu")
    default = resolve_mxfp4_kernel(None, "mxfp8", cpu)
    assert default["backend_resolved"] == "triton" and "SM-based default is triton" in default["kernel_notes"][0]
    assert "torch_mxfp4_moe runs, the torch reference" in default["kernel_notes"][1]
    assert "unused" in default["kernel_notes"][2]
    assert resolve_mxfp4_kernel("triton", "bf16", cpu)["backend_resolved"] == "triton"
    with _warnings() as warned:
        trt = resolve_mxfp4_kernel("trtllm", "bf16", cpu)
    assert trt["backend_resolved"] == "triton" and trt["trtllm_quant_act"] == "bf16"
    assert any("falling back to triton" in m for m in warned)
