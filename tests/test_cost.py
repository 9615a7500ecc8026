"""The cost model (``workbench.analysis.cost``): FLOPs and bytes of single nodes against hand-computed
values, sanity relations on a tiny:llama decode step, what fuse_gemms changes, the pipeline table."""

from __future__ import annotations

import pytest
import torch

import workbench.ops  # noqa: F401 - registers torch.ops.workbench
from workbench.analysis.cost import H100, SizeBinding, by_category, cost_across_pipeline, node_cost, node_costs
from workbench.analysis.cost.devices import DeviceProfile

ONE_THREAD = True
PROFILE = DeviceProfile("test", 1e12, 1e11, 1e11, 1e-6, None, "a fixed profile: tensors at the graph's dtypes")
wb_ops = torch.ops.workbench


def _only_node(module: torch.nn.Module, args, target):
    """Export ``module`` on ``args`` (static shapes) and return (graph module, the node calling ``target``)."""
    gm = torch.export.export(module, args).graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]
    assert len(nodes) == 1, [n.target for n in gm.graph.nodes]
    return gm, nodes[0]


def _cost(module, args, target, phase="decode", float_bytes=None):
    gm, node = _only_node(module, args, target)
    return node_cost(node, SizeBinding(gm, phase), float_bytes)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.lin(x)


def test_linear_flops_and_bytes():
    c = _cost(_Linear(), (torch.randn(4, 64),), torch.ops.aten.linear.default)
    assert c.category == "matmul" and c.launches == 1
    assert c.flops == 2 * 4 * 64 * 32
    assert c.bytes == (4 * 64 + 32 * 64 + 32 + 4 * 32) * 4  # x, weight, bias, out in fp32
    half = _cost(_Linear(), (torch.randn(4, 64),), torch.ops.aten.linear.default, float_bytes=2)
    assert half.bytes == c.bytes / 2  # the H100 profile counts fp32 tensors as bf16


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return wb_ops.torch_attention(q, k, v, is_causal=True, layout="bnsd")


def test_causal_attention_flops_and_bytes():
    b, h, n_kv, s, d = 1, 4, 2, 8, 16
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, n_kv, s, d), torch.randn(b, n_kv, s, d)
    c = _cost(_Attention(), (q, k, v), wb_ops.torch_attention.default)
    pairs = s * (s + 1) // 2  # the causal triangle: 36 (query, key) pairs per head
    assert c.category == "attention"
    assert c.flops == 2 * h * (d + d) * pairs  # QK^T and PV: 2*d FLOPs each per pair
    assert c.bytes == (q.numel() + k.numel() + v.numel() + q.numel()) * 4


class _RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        return wb_ops.torch_rmsnorm(x, self.weight, 1e-6)


def test_rmsnorm_flops_and_bytes():
    c = _cost(_RMSNorm(), (torch.randn(2, 8, 64),), wb_ops.torch_rmsnorm.default)
    assert c.category == "norm"
    assert c.flops == 4 * 2 * 8 * 64
    assert c.bytes == (2 * 8 * 64 + 64 + 2 * 8 * 64) * 4


class _Int4Linear(torch.nn.Module):
    """N=32 outputs, K=64 inputs, groups of 32: packed codes [32, 32] uint8, fp16 scales/offsets [32, 2]."""

    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.randint(0, 255, (32, 32), dtype=torch.uint8))
        self.register_buffer("scales", torch.rand(32, 2, dtype=torch.float16))
        self.register_buffer("offsets", torch.rand(32, 2, dtype=torch.float16))

    def forward(self, x):
        return wb_ops.torch_int4_linear(x, self.qweight, self.scales, self.offsets, 32)


def test_int4_linear_counts_its_real_weight_bytes():
    c = _cost(_Int4Linear(), (torch.randn(1, 64),), wb_ops.torch_int4_linear.default)
    assert c.category == "quant"
    assert c.flops == 2 * 1 * 32 * 64
    weight = 32 * 32 + 2 * (32 * 2 * 2)  # 0.5 B per weight + an fp16 scale and offset per 32 weights
    assert weight / (32 * 64) == pytest.approx(0.5 + 4 / 32)
    assert c.bytes == 64 * 4 + weight + 32 * 4


def test_decode_step_of_tiny_llama_streams_the_linear_weights(tiny_llama_done):
    wb = tiny_llama_done
    frame = node_costs(wb.module, "decode", PROFILE)
    cats = by_category(frame)
    linears = [m for m in wb.loaded.model.modules() if isinstance(m, torch.nn.Linear)]  # LM head included
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # every linear weight read once (the fused q/k/v and gate/up weights are the same bytes), plus
    # the activations of one token: a few percent of a tiny model's weights
    assert weights <= cats.loc["matmul", "bytes"] <= 1.05 * weights
    assert cats.loc["view", "bytes"] == 0 and cats.loc["view", "launches"] == 0
    # the 512th token attends 512 positions: 2 * heads * (d + d) FLOPs each, per layer
    cfg = wb.loaded.config
    d = cfg.hidden_size // cfg.num_attention_heads
    assert cats.loc["attention", "flops"] == cfg.num_hidden_layers * 2 * cfg.num_attention_heads * 2 * d * 512
    # the roofline is at least the launches' time and at most compute + memory + launches
    total = frame["time_s"].sum()
    assert total >= frame["launches"].sum() * PROFILE.launch_s
    h100 = node_costs(wb.module, "decode", H100)  # fp32 tensors counted as bf16
    assert h100["bytes"].sum() == pytest.approx(frame["bytes"].sum() / 2, rel=0.01)
    prefill = node_costs(wb.module, "prefill", PROFILE)
    assert prefill["flops"].sum() > 100 * frame["flops"].sum()  # 512 tokens against 1


def test_fuse_gemms_keeps_flops_and_cuts_launches(tiny_llama_done):
    wb = tiny_llama_done
    before = node_costs(wb.snapshot("load_weights").module, "decode", PROFILE)
    after = node_costs(wb.snapshot("fuse_gemms").module, "decode", PROFILE)
    assert after["flops"].sum() == pytest.approx(before["flops"].sum(), rel=1e-12)
    assert after["launches"].sum() < before["launches"].sum()
    assert after["time_s"].sum() < before["time_s"].sum()


def test_across_pipeline_has_one_row_per_transform(tiny_llama_done):
    wb = tiny_llama_done
    frame = cost_across_pipeline(wb, "h100", measure=False)
    assert list(frame["transform"]) == [s.key for s in wb.snapshots]
    row = frame.set_index("transform")
    # the KV cache turns a decode step from a re-run of 512 tokens into one token's work (on the H100
    # profile a model this tiny is launch-bound either way: FLOPs show it)
    assert row.loc["insert_cached_attention", "decode_GFLOP"] < 0.01 * row.loc["linear_weight_layout", "decode_GFLOP"]
    assert row.loc["fuse_gemms", "launches"] < row.loc["load_weights", "launches"]
    # a prefill already computes every token once: the cache changes little there
    assert row.loc["insert_cached_attention", "predicted_prefill_us_per_token"] == pytest.approx(
        row.loc["linear_weight_layout", "predicted_prefill_us_per_token"], rel=0.2
    )


def test_cost_table_puts_measured_beside_predicted(tiny_llama_done):
    wb = tiny_llama_done
    table = wb.cost_table(wb.snapshots[-1].key, device="h100", phase="decode", measure=True, threads=1)
    assert list(table.index) == ["matmul", "attention", "norm", "elementwise", "moe", "quant", "view", "other", "total"]
    assert table.loc["total", "launches"] == table["launches"].iloc[:-1].sum()
    assert table.loc["matmul", "measured_ms"] > 0 and table.loc["total", "measured_ms"] > 0
    prefill = wb.cost_table("export_to_gm", phase="prefill")  # before load_weights: costed from meta values
    assert "predicted_us/token" in prefill.columns and prefill.loc["attention", "GFLOP"] > 0
