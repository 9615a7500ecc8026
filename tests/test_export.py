"""export_to_gm on every tiny arch and on SmolLM2: logits equal to HF eager, dynamic batch/seq."""

import contextlib

import pytest
import torch

from workbench import Workbench
from workbench.models import list_tiny_archs, load_model
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.pipeline.transforms.export.patches import EXPORT_PATCHES

SECOND_SHAPE = (3, 5)  # a batch/sequence the graph was not exported with


def export_and_compare(loaded, shapes=((2, 16), SECOND_SHAPE)):
    wb = Workbench(loaded, numerics=False)
    snap = wb.step()
    assert snap.key == "export_to_gm"
    eager = CausalLMLogits(loaded.model)
    for b, s in shapes:
        vocab = loaded.config.get_text_config().vocab_size
        batch = make_batch(vocab, b, s, seed=b * 100 + s)
        with torch.no_grad():  # the graph is meta-traced: forward() binds the weights by name
            ref, out = eager(*batch.args), wb.forward(*batch.args)
        assert out.shape == (b, s, vocab)
        # fp32 round-off: 1e-5 of the logits' scale (up to ~10 at the tiny models' init, models/tiny.py)
        assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    return wb, snap


# families whose every layer is plain attention: one SDPA per layer after export (the others --
# SSM, conv, delta-rule, MLA layers -- export as their canonical ops; their own tests count them)
CORE_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}


@pytest.mark.parametrize("arch", list_tiny_archs())
def test_export_tiny_arch_matches_eager(arch):
    loaded = load_model(f"tiny:{arch}")
    _, snap = export_and_compare(loaded)
    if arch in CORE_ARCHS:
        assert snap.op_histogram.get("aten.scaled_dot_product_attention.default", 0) == (
            loaded.config.num_hidden_layers
        )
    # every patch on by default was applied (the canonical module forwards touch only their own classes)
    assert set(snap.info.details["patches"]) == {n for n, p in EXPORT_PATCHES.items() if p.enabled_by_default}


@pytest.mark.slow
def test_export_smollm2_matches_eager(smollm2):
    wb, snap = export_and_compare(smollm2, shapes=((2, 12), (1, 7)))
    hist = snap.op_histogram
    assert hist["aten.scaled_dot_product_attention.default"] == 30
    assert hist["aten.linear.default"] == 211
    assert snap.info.details["trace_device"] == "meta"
    on_cpu = Workbench(smollm2, numerics=False, overrides=["export_to_gm.trace_device=model"]).step()
    assert on_cpu.op_histogram == hist and snap.info.details["normalized"]["contiguous_before_reshape"] == 30
    # The post-export cleanups keep the logits bit-identical.
    wb.numerics_enabled = True
    wb.run_to("cleanup_input_constraints")
    assert all(s.numerics.max_abs <= 1e-5 for s in wb.snapshots[1:])


def test_packed_sequence_patch_removes_position_dependent_mask(tiny_llama):
    on = Workbench(tiny_llama, numerics=False)
    on.step()
    off = Workbench(tiny_llama, numerics=False, overrides=["export_to_gm.patches.no_packed_sequence_mask=false"])
    off.step()
    h_on, h_off = on.snapshots[0].op_histogram, off.snapshots[0].op_histogram
    assert "aten.cumsum.default" in h_off and "aten.cumsum.default" not in h_on
    assert on.snapshots[0].num_nodes < off.snapshots[0].num_nodes
    batch = make_batch(512, 2, 6, seed=3)
    torch.testing.assert_close(on.forward(*batch.args), off.forward(*batch.args), rtol=0, atol=1e-5)


def test_export_patches_are_listed_and_switchable():
    assert {"no_packed_sequence_mask", "eval_mode"} <= set(EXPORT_PATCHES)
    assert all(p.description for p in EXPORT_PATCHES.values())


def test_exported_graph_has_dynamic_dims(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False, max_batch_size=16, max_seq_len=128)
    wb.run_to("cleanup_input_constraints")  # later stages add cache inputs to the signature
    assert wb.module.meta["dynamic_dims"] == {"batch": (1, 16), "seq": (1, 128)}
    # after cleanup_input_constraints the graph accepts shapes export never saw, incl. seq 1 (decode)
    for b, s in [(1, 1), (5, 33)]:
        batch = make_batch(512, b, s, seed=s)
        with torch.no_grad():
            torch.testing.assert_close(
                wb.forward(*batch.args), CausalLMLogits(tiny_llama.model)(*batch.args), rtol=0, atol=1e-5
            )


# ------------------------------------------------------------------------------ device-neutral trace


@pytest.mark.parametrize("arch", list_tiny_archs())
def test_meta_trace_has_the_same_ops_as_the_trace_on_the_weights_device(arch):
    """export_to_gm traces a weightless meta twin by default; the graph must not depend on that:
    the same op histogram as tracing the model where its weights are (CPU here)."""
    loaded = load_model(f"tiny:{arch}")
    on_meta = Workbench(loaded, numerics=False)
    snap = on_meta.step()
    on_cpu = Workbench(loaded, numerics=False, overrides=["export_to_gm.trace_device=model"])
    ref = on_cpu.step()
    assert snap.info.details["trace_device"] == "meta" and ref.info.details["trace_device"] == "cpu"
    # One difference is the CPU's, not the graph's: CPU SDPA returns its [b, h, s, d] output laid out
    # as [b, s, h, d], so an attention output's ``transpose(1, 2).contiguous()`` is a no-op there and
    # export records no contiguous; meta SDPA returns it laid out as [b, h, s, d] (JetMoE, AFMoE).
    # A contiguous of a contiguous tensor returns it: the graphs compute the same, at the same cost.
    contiguous = "aten.contiguous.default"
    meta_ops, cpu_ops = dict(snap.op_histogram), dict(ref.op_histogram)
    assert meta_ops.pop(contiguous, 0) >= cpu_ops.pop(contiguous, 0)
    assert meta_ops == cpu_ops
    # the meta graph holds no weights (0 bytes) and its factories name device=meta until loaded
    assert all(t.is_meta for t in on_meta.module.parameters())
    assert snap.mem_after.param_bytes == 0 and ref.mem_after.param_bytes > 0


def test_exported_graph_runs_at_every_batch_and_sequence_size(tiny_llama):
    """Export reports ranges from 2 (its 0/1 specialisation); the graph must still take batch 1,
    sequence 1 and odd sizes up to 512, before load_weights (weights bound on the fly) and after."""
    wb = Workbench(tiny_llama, numerics=False, max_batch_size=8, max_seq_len=512)
    snap = wb.step()
    assert set(snap.info.details["export_ranges"]) == {"batch", "seq"}
    eager = CausalLMLogits(tiny_llama.model)
    wb.run_to("load_weights")
    seqs = (1, 2, 3, 7, 16, 33, 128, 255, 511, 512)
    for b in range(1, 9):
        for s in seqs if b in (1, 2, 5, 8) else (1, 17, 512):
            batch = make_batch(512, b, s, seed=b * 1000 + s)
            with torch.no_grad():
                ref = eager(*batch.args)
            torch.testing.assert_close(wb.forward(*batch.args), ref, rtol=0, atol=1e-5)
    # the graph before load_weights (meta tensors) runs too, with the weights bound by name
    batch = make_batch(512, 1, 1, seed=5)
    pre = wb.forward(*batch.args, at="export_to_gm")
    torch.testing.assert_close(pre, eager(*batch.args), rtol=0, atol=1e-5)


class _LiteralInForward(torch.nn.Module):
    """Uses a tensor literal made on its input's device, as transformers 5.17's eager mask does
    (``torch.where(mask, torch.tensor(0.0, device=mask.device), min)``)."""

    def forward(self, x):
        return torch.where(x > 0, torch.tensor(0.5, device=x.device), -1.0)


@pytest.mark.parametrize("on", [True, False])
def test_tensor_literals_on_cpu_patch_keeps_the_literals_value_in_a_meta_trace(on):
    patch = EXPORT_PATCHES["tensor_literals_on_cpu"]
    assert patch.enabled_by_default
    mod = _LiteralInForward()
    x = torch.randn(4, device="meta")
    with (patch.enter(mod) if on else contextlib.nullcontext()):
        gm = torch.export.export(mod, (x,), strict=False).module()
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(constants) == 1 and constants[0].shape == ()
    if on:  # a real CPU 0-dim tensor: the graph runs once its inputs are real, on any device
        assert constants[0].device.type == "cpu" and constants[0].item() == 0.5
        real = torch.tensor([1.0, -2.0, 3.0, 0.0])
        assert gm(real).tolist() == [0.5, -1.0, 0.5, -1.0]
    else:  # the value is lost: what the patch is for
        assert constants[0].is_meta


class _LiteralCausalMask(torch.nn.Module):
    """transformers 5.17's eager mask: where(k_pos <= q_pos, torch.tensor(0.0), finfo.min)."""

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        causal = (pos[None, :] <= pos[:, None])[None, None]
        return torch.where(causal, torch.tensor(0.0, device=x.device), torch.finfo(torch.float32).min)


def test_a_causal_mask_built_with_a_lifted_literal_is_classified_causal():
    from workbench.pipeline.matcher.masks import MaskKind, classify_mask

    mod = _LiteralCausalMask()
    x = torch.randn(2, 6, device="meta")
    dims = ({1: torch.export.Dim.DYNAMIC(min=2, max=64)},)
    with EXPORT_PATCHES["tensor_literals_on_cpu"].enter(mod):
        gm = torch.export.export(mod, (x,), dynamic_shapes=dims, strict=False).module()
    mask = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    seq = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[1]
    assert classify_mask(mask, seq) == MaskKind(is_causal=True)


def test_a_loop_over_the_tokens_is_refused_naming_its_line_and_module():
    """RWKV's WKV recurrence is a Python loop over the tokens: export fixes the sequence length, and
    the refusal names the loop's line and the module it runs in (not only torch's "Constraints
    violated"); the HF class has no SDPA path, so the tiny build picks eager attention by itself."""
    from transformers import RwkvConfig

    from workbench.pipeline.interface import TransformError

    def rwkv():
        return RwkvConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                          intermediate_size=64, context_length=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)

    loaded = load_model("tiny:rwkv", tiny_registry={"rwkv": rwkv}, dtype="float32")
    assert loaded.config._attn_implementation == "eager"
    with pytest.raises(TransformError) as err:  # 3 example tokens: the diagnosis re-traces the unrolled loop
        Workbench(loaded, numerics=False, overrides={"export_to_gm.example_seq_len": 3}).step()
    msg = str(err.value.cause)
    assert msg.startswith("the sequence length was fixed during tracing by `for current_index in range(seq_length):`")
    assert "(RwkvSelfAttention)" in msg and "blocks.0.attention" in msg and "canonical op" in msg
