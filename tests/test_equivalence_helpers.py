"""workbench.testing: the hierarchical equivalence helpers on real HF modules against canonical ops,
and that each level fails (with the level named) when the custom side is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import workbench.ops  # noqa: F401 - registers torch.ops.workbench
from workbench.api import Workbench
from workbench.models import load_model
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.tiny import build_tiny_config
from workbench.testing import (EquivalenceError, assert_rmse_close, check_block, check_export, check_model,
                               copy_weights, rmse_ratio)

W = torch.ops.workbench


class CanonicalRMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        return W.torch_rmsnorm(x, self.weight, self.eps)


class CanonicalMLP(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return W.torch_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


@pytest.fixture(scope="module")
def config():
    return build_tiny_config("llama")


def test_blocks_against_hf_modules(config):
    torch.manual_seed(0)
    x = torch.randn(2, 7, config.hidden_size)
    hf_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    torch.nn.init.normal_(hf_norm.weight)
    norm = CanonicalRMSNorm(config.hidden_size, config.rms_norm_eps)
    copy_weights(hf_norm, norm)
    assert check_block(hf_norm, norm, x, tol=1e-6) < 1e-6
    hf_mlp = LlamaMLP(config)
    mlp = CanonicalMLP(config.hidden_size, config.intermediate_size)
    copy_weights(hf_mlp, mlp)
    check_block(hf_mlp, mlp, x, tol=1e-5, identical_math=True)  # plain linears + silu: element-wise


def test_each_level_names_what_failed(config):
    torch.manual_seed(1)
    x = torch.randn(2, 5, config.hidden_size)
    hf_mlp, mlp = LlamaMLP(config), CanonicalMLP(config.hidden_size, config.intermediate_size)
    copy_weights(hf_mlp, mlp)
    with torch.no_grad():
        mlp.up_proj.weight[0, 0] += 1.0  # one wrong weight
    with pytest.raises(EquivalenceError, match=r"block: rmse ratio .* > tolerance 1.0e-05"):
        check_block(hf_mlp, mlp, x, tol=1e-5)
    with pytest.raises(EquivalenceError, match="weights do not line up: missing"):
        copy_weights(LlamaRMSNorm(config.hidden_size), mlp)
    with pytest.raises(EquivalenceError, match="non-finite"):
        assert_rmse_close(torch.tensor([1.0, float("nan")]), torch.ones(2), 1.0)
    assert rmse_ratio(torch.ones(3), torch.ones(3)) == 0.0


def test_model_and_export_levels_on_the_pipeline_graph():
    loaded = load_model("tiny:llama")
    wb = Workbench(loaded, numerics=False)
    wb.run_to("detect_hidden_states_for_capture")  # the canonical-op graph (meta until load_weights)
    wb.run_to("load_weights")
    batch = make_batch(loaded.config.vocab_size, 2, 9, seed=3)
    assert check_model(loaded.model, wb.module, *batch.args, tol=1e-5) < 1e-5
    gm = check_export(CausalLMLogits(loaded.model), *batch.args, second=(3, 4))
    assert isinstance(gm, torch.fx.GraphModule)
