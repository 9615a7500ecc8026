"""export_to_gm on every tiny arch and on SmolLM2: logits equal to HF eager, dynamic batch/seq."""

import pytest
import torch

from workbench import Workbench
from workbench.models import list_tiny_archs, load_model
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.pipeline.transforms.export_patches import EXPORT_PATCHES

SECOND_SHAPE = (3, 5)  # a batch/sequence the graph was not exported with


def export_and_compare(loaded, shapes=((2, 16), SECOND_SHAPE)):
    wb = Workbench(loaded, numerics=False)
    snap = wb.step()
    assert snap.key == "export_to_gm"
    gm = wb.module
    eager = CausalLMLogits(loaded.model)
    for b, s in shapes:
        batch = make_batch(loaded.config.vocab_size, b, s, seed=b * 100 + s)
        with torch.no_grad():
            ref, out = eager(*batch.args), gm(*batch.args)
        assert out.shape == (b, s, loaded.config.vocab_size)
        assert (out - ref).abs().max().item() <= 1e-5
    return wb, snap


@pytest.mark.parametrize("arch", list_tiny_archs())
def test_export_tiny_arch_matches_eager(arch):
    loaded = load_model(f"tiny:{arch}")
    _, snap = export_and_compare(loaded)
    assert snap.op_histogram.get("aten.scaled_dot_product_attention.default", 0) == (
        loaded.config.num_hidden_layers
    )
    assert set(snap.info.details["patches"]) == {"no_packed_sequence_mask", "eval_mode"}


@pytest.mark.slow
def test_export_smollm2_matches_eager(smollm2):
    wb, snap = export_and_compare(smollm2, shapes=((2, 12), (1, 7)))
    hist = snap.op_histogram
    assert hist["aten.scaled_dot_product_attention.default"] == 30
    assert hist["aten.linear.default"] == 211
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
    torch.testing.assert_close(on.module(*batch.args), off.module(*batch.args), rtol=0, atol=1e-5)


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
                wb.module(*batch.args), CausalLMLogits(tiny_llama.model)(*batch.args), rtol=0, atol=1e-5
            )
