"""The reference transforms that used to fire only on hand-built graphs, on real families.

* ``match_bmm_moe_pattern``: Llama-4's MoE (``Llama4TextMoe`` + ``Llama4TextExperts``: every
  expert sees every token, pre-scaled by its sigmoid score, two ``bmm`` on the stacked
  ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``) -> ``torch_moe_dense_mlp`` on ``tiny:llama4_text``.
* ``match_l2norm_pattern``: Llama-4's QK norm (``Llama4TextL2Norm``: ``x * rsqrt(mean(x**2) + eps)``,
  no weight, in fp32 then ``type_as(x)``) -> ``torch_l2norm(x, D * eps) * sqrt(D)``: one per q and k
  of the RoPE layer (the NoPE layer has none). ``match_rmsnorm_pattern`` takes Llama-4's weighted
  RMSNorm (the same chain times the weight) first.
* ``export_to_gm.num_moe_experts_for_export``: ``tiny:qwen3_moe`` (4 experts) traced with 2, the
  graph then bound to all 4: the same graph as a full export, and HF's tokens.
* ``quantize_fp8_bmm_from_config``: ``save_tiny_quantized("llama4_text", "FP8")`` stores Llama-4's
  stacked experts in fp8 with per-tensor ``<p>_weight_scale`` / ``<p>_input_scale`` (ModelOpt's
  layout); ``match_bmm_moe_pattern`` leaves those experts' BMMs alone (the dense MoE op has no FP8
  form) and ``quantize_fp8_bmm_from_config`` makes both ``torch_fp8_bmm``. FP8 rounds activations,
  so the reference is the dequantized twin with every quantized input rounded the same way
  (``rounded_activations`` for the linears, the experts' two BMM inputs here): tokens equal.
* ``match_dense_moe_pattern`` has no real form in transformers 5.x (the notes at the end).

Tolerances: the probe compares fp32 logits with HF eager; the rewrites compute the same values in
another order (the L2 form's ``D * eps`` and ``sqrt(D)``), so 1e-5 relative RMSE; tokens are exact.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.quantized_twin import rounded_activations
from workbench.models.tiny_quantized import save_tiny_quantized
from workbench.ops.quant.fp8 import fp8_qdq

ONE_THREAD = True  # see conftest.one_thread
NEW = 16
TOL = 1e-5


def _prompts(vocab):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 11)]


def _count(gm, suffix):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target).endswith(suffix))


@pytest.fixture(scope="module")
def llama4():
    """``tiny:llama4_text`` through the whole default pipeline (numerics probe on every step)."""
    loaded = load_model("tiny:llama4_text")
    bench = Workbench(loaded)
    bench.run_to("match_l2norm_pattern")
    counts = {s: _count(bench.module, s) for s in (  # right after the norm step, before later fusions
        "torch_moe_dense_mlp.default", "torch_l2norm.default", "torch_rmsnorm.default", "aten.bmm.default",
        "aten.rsqrt.default")}
    bench.run()
    return loaded, bench, counts


def test_bmm_moe_fires_on_llama4(llama4):
    loaded, bench, counts = llama4
    moe_layers = sum(type(m).__name__ == "Llama4TextMoe" for m in loaded.model.modules())
    snap = bench.snapshot("match_bmm_moe_pattern")
    assert moe_layers == 1 and snap.info.num_matches == moe_layers, snap.info
    assert counts["torch_moe_dense_mlp.default"] == moe_layers and counts["aten.bmm.default"] == 0
    assert snap.numerics is not None and snap.numerics.rmse_ratio <= TOL, snap.numerics


def test_l2norm_fires_on_llama4_qk_norm(llama4):
    loaded, bench, counts = llama4
    qk_norms = sum(type(m).__name__ == "Llama4TextL2Norm" for m in loaded.model.modules())
    rms_norms = sum(type(m).__name__ == "Llama4TextRMSNorm" for m in loaded.model.modules())
    snap = bench.snapshot("match_l2norm_pattern")
    assert qk_norms == 1 and snap.info.num_matches == 2 * qk_norms, snap.info  # q and k
    assert bench.snapshot("match_rmsnorm_pattern").info.num_matches == rms_norms
    assert counts["torch_l2norm.default"] == 2 and counts["torch_rmsnorm.default"] == rms_norms
    assert counts["aten.rsqrt.default"] == 0  # every norm chain became an op
    assert snap.numerics is not None and snap.numerics.rmse_ratio <= TOL, snap.numerics


def test_llama4_pipeline_generates_hf_tokens(llama4):
    loaded, bench, _ = llama4
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(loaded.model, p, NEW), f"prompt of {len(p)} tokens"


def _graph_ops(gm):
    return [(n.op, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]


def test_export_with_two_experts_equals_full_export_and_hf(monkeypatch):
    """``tiny:qwen3_moe`` (4 experts per MoE layer) exported with 2: export sees [2, ...] stacked
    experts (spied on), the graph's tensors are then [4, ...] on meta, the graph equals a full
    export node for node, and the finished pipeline generates HF's tokens with all 4 experts."""
    loaded = load_model("tiny:qwen3_moe")
    n_exp = loaded.config.num_experts
    assert n_exp == 4
    seen = []
    real_export = torch.export.export

    def spy(module, *args, **kwargs):
        seen.extend((k, tuple(p.shape)) for k, p in module.named_parameters() if k.endswith("experts.gate_up_proj"))
        return real_export(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spy)
    bench = Workbench(loaded)
    bench.configure("export_to_gm", num_moe_experts_for_export=2)
    snap = bench.step()
    monkeypatch.setattr(torch.export, "export", real_export)
    assert seen and all(shape[0] == 2 for _, shape in seen), seen
    traced = snap.info.details["moe_experts_traced"]
    assert len(traced) == 2 * loaded.config.num_hidden_layers and all(s[0] == 2 for s in traced.values())
    params = dict(bench.module.named_parameters())
    assert all(params[k].shape[0] == n_exp and params[k].is_meta for k in traced)
    assert snap.numerics is not None and snap.numerics.rmse_ratio == 0.0, snap.numerics

    full = Workbench(load_model("tiny:qwen3_moe"), numerics=False)
    full.step()
    assert _graph_ops(bench.module) == _graph_ops(full.module)

    bench.run()
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert [r.token_ids for r in out.results] == [_hf_greedy(loaded.model, p, NEW) for p in prompts]


def test_export_with_fewer_experts_refuses_what_it_cannot_cut():
    """A model without stacked experts says so; Llama-4's experts read the count from their weights
    (``view(gate_up_proj.shape[0], ...)``): not transformers' experts interface, so nothing is cut."""
    for arch in ("llama", "llama4_text"):
        bench = Workbench(load_model(f"tiny:{arch}"), numerics=False)
        bench.configure("export_to_gm", num_moe_experts_for_export=2)
        with pytest.raises(Exception, match="no stacked experts module"):
            bench.step()


@contextlib.contextmanager
def _rounded_bmm_experts(loaded):
    """Llama-4's experts of the dequantized twin with both BMM inputs rounded to fp8 by the
    checkpoint's input scales, as ``torch_fp8_bmm`` rounds them (the weights are the twin's
    dequantized ones: ``fp8 * weight_scale``, what the op multiplies by)."""
    ck = loaded.checkpoint
    patched = []
    for name, m in loaded.model.named_modules():
        if type(m).__name__ != "Llama4TextExperts":
            continue
        s13, s2 = ck.tensors[f"{name}.gate_up_proj_input_scale"], ck.tensors[f"{name}.down_proj_input_scale"]

        def forward(hidden_states, m=m, s13=s13, s2=s2):
            x = hidden_states.view(m.gate_up_proj.shape[0], -1, m.hidden_size)
            gate, up = torch.bmm(fp8_qdq(x, s13), m.gate_up_proj).chunk(2, dim=-1)
            return torch.bmm(fp8_qdq(up * m.act_fn(gate), s2), m.down_proj).view(-1, m.hidden_size)

        m.forward = forward
        patched.append(m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def test_fp8_bmm_fires_on_llama4_fp8_checkpoint(tmp_path):
    directory = save_tiny_quantized("llama4_text", "FP8", tmp_path)
    loaded = load_model(str(directory))
    ck = loaded.checkpoint
    experts = "model.layers.1.feed_forward.experts"
    for p in ("gate_up_proj", "down_proj"):  # stored fp8 + per-tensor scales; the twin dequantized
        assert ck.tensors[f"{experts}.{p}"].dtype == torch.float8_e4m3fn
        want = ck.tensors[f"{experts}.{p}"].float() * ck.tensors[f"{experts}.{p}_weight_scale"]
        assert torch.equal(loaded.model.get_parameter(f"{experts}.{p}").detach(), want)
    bench = Workbench(loaded)
    bench.run_to("quantize_fp8_bmm_from_config")
    bmm_moe = bench.snapshot("match_bmm_moe_pattern").info
    assert bmm_moe.num_matches == 0 and len(bmm_moe.details["left_fp8"]) == 2, bmm_moe
    snap = bench.snapshot("quantize_fp8_bmm_from_config")
    assert snap.info.num_matches == 2, snap.info
    assert snap.info.details["quantized"] == [f"{experts}.gate_up_proj", f"{experts}.down_proj"]
    assert _count(bench.module, "torch_fp8_bmm.default") == 2 and _count(bench.module, "aten.bmm.default") == 0
    # activations rounded to fp8: within the bound test_quantized_checkpoints uses for FP8
    assert snap.numerics is not None and snap.numerics.rmse_ratio <= 0.35, snap.numerics
    bench.run()
    prompts = _prompts(loaded.config.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    with rounded_activations(loaded) as linears, _rounded_bmm_experts(loaded) as n_experts:
        assert linears == 15 and n_experts == 1
        assert out.token_ids == [_hf_greedy(loaded.model, p, NEW) for p in prompts]


# Notes: match_dense_moe_pattern (all experts on every token, weighted on the output) has no real
# form in transformers 5.x: 67 modeling files route experts through ``@use_experts_implementation``
# (grouped_mm / batched_mm: match_moe_pattern); DBRX, JetMoe, LongCat-Flash, Step3p7 and gpt-oss's
# eager path loop over the experts that got tokens (data-dependent, no export); Llama-4 weights the
# *input* (match_bmm_moe_pattern, above). No modeling file of a causal LM repeats the tokens over all
# experts and weights the outputs (``repeat(num_experts``: only nllb_moe, an encoder-decoder).
