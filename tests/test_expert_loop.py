"""MoE experts that loop over the experts that received tokens (``models/canonical/expert_loop.py``).

* recognition by structure: DBRX's flat GLU experts and LongCat-Flash's stacked ones (with identity
  experts) are taken, experts behind transformers' experts interface (Mixtral) are not;
* the canonical forward equals HF's own experts module on the same inputs -- routing that hits every
  expert, none of some, and LongCat's identity experts (indices past the routed ones);
* export: the loop (a data-dependent ``GuardOnDataDependentSymNode`` failure before) becomes one MoE op
  per MoE layer. Cached greedy tokens equal to HF: ``test_more_families`` (both are registry families).
"""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.models import load_model
from workbench.models.canonical.expert_loop import expert_layout, expert_loop_forward

ONE_THREAD = True  # see conftest.one_thread

#: arch: (layout, MoE op in the exported graph, MoE layers)
FAMILIES = {"dbrx": ("flat_glu", "workbench.torch_moe.default", 2),
            "longcat_flash": ("stacked", "workbench.torch_moe_fused.default", 2)}


def _experts(model):
    return [m for m in model.modules() if expert_layout(m) is not None]


def test_interface_experts_are_not_taken():
    model = load_model("tiny:mixtral").model
    assert [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert _experts(model) == []


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_canonical_forward_equals_hf_experts(arch):
    layout, _, layers = FAMILIES[arch]
    model = load_model(f"tiny:{arch}", dtype="float32").model
    experts = _experts(model)
    assert len(experts) == layers and {expert_layout(m) for m in experts} == {layout}
    g = torch.Generator().manual_seed(0)
    for m in experts:
        hidden = 64
        total = m.gate_up_proj.shape[0] if layout == "stacked" else m.num_experts  # identity experts included
        tokens, k = 11, 2
        x = torch.randn(tokens, hidden, generator=g)
        # every expert id at least once (identity experts too), then random picks; distinct per token
        index = torch.stack([torch.randperm(total, generator=g)[:k] for _ in range(tokens)])
        n = min(tokens, total)
        index[:n, 0] = torch.arange(n)
        index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % total, index[:, 1])
        weights = torch.rand(tokens, k, generator=g)
        with torch.no_grad():
            ref = m(x, index, weights)
            out = expert_loop_forward(m, x, index, weights)
        assert ref.abs().mean() > 1e-3
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if layout == "stacked":  # identity experts were hit and matter
            assert (index >= m.down_proj.shape[0]).any()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_export_has_one_moe_op_per_moe_layer(arch):
    _, op, layers = FAMILIES[arch]
    snap = Workbench(f"tiny:{arch}", numerics=False).step()
    assert snap.key == "export_to_gm" and snap.op_histogram.get(op) == layers
    assert "canonical_expert_loop" in snap.info.details["patches"]
