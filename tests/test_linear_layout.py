"""linear_weight_layout: how CPU linears read their weights -- the C++ kernel, (W @ x.T).T on the
weights as loaded (``wxt``), K-major copies (``kn``) or as loaded (``nk``), ``auto`` taking what this
CPU measured fastest -- checked against HF on the same weights."""

from __future__ import annotations

import pytest
import torch

from workbench import Workbench
from workbench.models.export_contract import make_batch
from workbench.ops import cpu_kernels

KEY = "linear_weight_layout"


def run_to_layout(loaded, layout):
    wb = Workbench(loaded, overrides={f"{KEY}.layout": layout})
    wb.run_to(KEY)
    return wb


def ops(snap, name):
    return snap.op_histogram.get(name, 0)


WXT = "workbench.cpu_linear_wxt.default"
KERNEL = "workbench.cpu_linear.default"
KERNELS_BUILD = cpu_kernels.load() is None
# what auto picked for fp32 linears (this CPU's calibration on the model's weights), and the op that
# then serves them
AUTO = {"kernel": (9, KERNEL), "wxt": (9, WXT), "nk": (0, "aten.matmul.default")}


@pytest.mark.parametrize("layout, expected, op", [("auto", None, None), ("wxt", 9, WXT),
                                                  ("kn", 9, "aten.matmul.default"), ("nk", 0, "aten.matmul.default"),
                                                  pytest.param("kernel", 9, KERNEL, marks=pytest.mark.skipif(
                                                      not KERNELS_BUILD, reason=f"CPU kernels: {cpu_kernels.load()}"))])
def test_rewrites_every_linear_and_keeps_logits(tiny_llama, layout, expected, op):
    # tiny:llama after fuse_gemms/fuse_swiglu, per layer: qkv 128x64, o 64x64, gate_up 256x64,
    # down 64x128, 2 layers, plus the 512x64 LM head: 9 linears.
    wb = run_to_layout(tiny_llama, layout)
    snap = wb.snapshot(KEY)
    if layout == "auto":  # the measured choice and the times behind it, in the details
        picked = snap.info.details["auto"].removeprefix("fp32 linears: ").split(" ", 1)[0]
        assert "calibrat" in snap.info.details["auto"] and f" {picked} " in snap.info.details["auto"]
        expected, op = AUTO[picked]
    assert snap.info.num_matches == expected
    assert ops(snap, op) == expected
    assert ops(snap, "aten.linear.default") == 9 - expected
    assert snap.numerics.rmse_ratio < 1e-6  # same products, another summation order at most
    batch = make_batch(tiny_llama.config.vocab_size, 2, 12, seed=3)
    with torch.no_grad():
        ref = tiny_llama.model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        got = snap.module(batch.input_ids, batch.position_ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 65])
def test_wxt_op_equals_linear_at_every_batch_size(rows):
    from workbench.ops.mlp.cpu_linear_wxt import linear_wxt

    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(1, rows, 96, generator=g), torch.randn(160, 96, generator=g), torch.randn(160, generator=g)
    for bias in (None, b):
        out = torch.ops.workbench.cpu_linear_wxt(x, w, bias)
        assert out.shape == (1, rows, 160) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(out, linear_wxt(x, w, bias))


def test_wxt_copies_nothing(tiny_llama):
    snap = run_to_layout(tiny_llama, "wxt").snapshot(KEY)
    assert snap.info.details["new_bytes"] == 0 and snap.mem_delta == 0 and snap.mem_warning is None


def test_kn_memory_delta_is_new_minus_freed_and_tied_head_costs_a_copy(tiny_llama):
    wb = run_to_layout(tiny_llama, "kn")
    snap = wb.snapshot(KEY)
    d = snap.info.details
    # the tied LM head keeps its table (embedding lookup): one extra 512 x 64 fp32 copy
    assert d["new_bytes"] - d["freed_bytes"] == 512 * 64 * 4
    assert "model.lm_head.weight" in d["kept_originals"]
    assert snap.mem_delta == d["new_bytes"] - d["freed_bytes"] and snap.mem_warning is None
    w = snap.module.get_parameter("model.lm_head.weight_kn")
    assert w.shape == (64, 512) and w.is_contiguous()
    assert torch.equal(w, tiny_llama.model.lm_head.weight.t())


def test_auto_leaves_cuda_graphs_alone(tiny_llama):
    from workbench.pipeline.transforms.fusion.linear_layout import LinearWeightLayout, LinearWeightLayoutConfig

    wb = run_to_layout(tiny_llama, "auto")
    t = LinearWeightLayout(LinearWeightLayoutConfig(stage="post_load_fusion"))
    ctx = type("Ctx", (), {"device": torch.device("cuda")})()
    gm = wb.snapshot("fuse_rope").module
    _, info = t._apply(gm, ctx)
    assert info.num_matches == 0 and info.details["layout"].startswith("nk")
