"""MoE matchers: match_moe_pattern (transformers grouped_mm / batched_mm experts),
match_bmm_moe_pattern, match_dense_moe_pattern, split_moe_fused_for_sharding and
match_moe_routing_pattern."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from match_support import all_gone, check, count, export, gone, run

wb = torch.ops.workbench
T, H, E, K = 6, 16, 4, 2
DYN = {0: {0: "batch", 1: "seq"}}


def sparse_moe_block(impl: str):
    """transformers' Mixtral sparse MoE block (router + stacked experts), tiny and random."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=8, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


class Block(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.moe = sparse_moe_block(impl)

    def forward(self, x):
        out = self.moe(x)
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_moe_pattern_on_transformers_experts(impl):
    x = torch.randn(2, 3, H)
    gm = check("match_moe_pattern", Block(impl), (x,), matches=1, dynamic=DYN, other_args=(torch.randn(3, 5, H),),
               atol=1e-5)
    assert count(gm, "workbench.torch_moe_fused.default") == 1
    assert all_gone(gm, ("transformers.grouped_mm_fallback.default", "aten.bmm.default", "aten.histc.default"))


def test_moe_pattern_near_miss_other_activation():
    def gelu_experts(x, selected, weights, w13, w2):  # batched_mm dispatch, GELU experts: not ours
        xs = x.repeat_interleave(K, dim=0)
        flat_e = selected.reshape(-1)
        h = torch.bmm(w13[flat_e], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(w2[flat_e], (F.gelu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = y * weights.reshape(-1).unsqueeze(-1)
        return y.view(x.shape[0], K, x.shape[-1]).sum(dim=1).to(x.dtype)

    sel = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    args = (torch.randn(T, H), sel, torch.rand(T, K), torch.randn(E, 8, H), torch.randn(E, H, 4))
    check("match_moe_pattern", gelu_experts, args, matches=0, dynamic={0: {0: "t"}, 1: {0: "t"}, 2: {0: "t"}},
          atol=1e-5)


def test_split_moe_fused_for_sharding_uses_views():
    x = torch.randn(2, 3, H)
    gm = export(Block("grouped_mm"), (x,), DYN)
    ref = gm(x)
    gm, _ = run("match_moe_pattern", gm)
    stacked = gm.get_parameter("moe.experts.gate_up_proj")
    gm, info = run("split_moe_fused_for_sharding", gm)
    assert info.num_matches == 1 and count(gm, "workbench.torch_moe.default") == 1
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_moe.default]
    assert [len(a) for a in node.args[3:6]] == [E, E, E]
    w1_0 = gm.get_parameter(node.args[3][0].target)
    assert w1_0.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()  # a view
    torch.testing.assert_close(gm(x), ref, atol=1e-5, rtol=1e-5)
    torch.export.export(gm, (x,), strict=False)
    gm, info = run("split_moe_fused_for_sharding", gm)  # nothing left to split
    assert info.num_matches == 0


def mixtral_router(logits):
    w = F.softmax(logits.float(), dim=-1)
    w, i = torch.topk(w, K, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    return w, i


def qwen3_moe_router(logits):
    w = F.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.topk(w, K, dim=-1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routing_pattern(backend):
    logits = torch.randn(T, E)
    op = f"workbench.{backend}_moe_topk_softmax.default"
    gm = check("match_moe_routing_pattern", mixtral_router, (logits,), matches=1, dynamic={0: {0: "t"}},
               other_args=(torch.randn(9, E),), backend=backend)
    assert count(gm, op) == 1 and gone(gm, "aten.softmax.int")
    (node,) = [n for n in gm.graph.nodes if "topk_softmax" in str(n.target)]
    assert node.args[1:] == (K, True)
    gm = check("match_moe_routing_pattern", qwen3_moe_router, (logits,), matches=1, dynamic={0: {0: "t"}},
               backend=backend)
    (node,) = [n for n in gm.graph.nodes if "topk_softmax" in str(n.target)]
    assert node.args[1:] == (K, False)


def test_routing_near_miss_sigmoid():
    def sigmoid_router(logits):
        w, i = torch.topk(torch.sigmoid(logits.float()), K, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), i

    check("match_moe_routing_pattern", sigmoid_router, (torch.randn(T, E),), matches=0, dynamic={0: {0: "t"}})


class Llama4StyleMoe(torch.nn.Module):
    """Llama-4 TextMoe without the shared expert: dense top-1 scores scale the experts' input
    (``on_input``) or its output; ``up_first``: the projection stores the up rows first
    (``up, gate = h.chunk(2)``)."""

    def __init__(self, on_input=True, inter=8, up_first=False):
        super().__init__()
        self.on_input, self.up_first = on_input, up_first
        self.router = torch.nn.Linear(H, E, bias=False)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, H, 2 * inter) * 0.2)
        self.down_proj = torch.nn.Parameter(torch.randn(E, inter, H) * 0.2)

    def forward(self, x):
        x = x.reshape(-1, H)
        logits = self.router(x)
        top, idx = torch.topk(logits, 1, dim=1)
        scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, idx, top))
        if self.on_input:
            routed = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
            h = torch.bmm(routed.view(E, -1, H), self.gate_up_proj)
            gate, up = h.chunk(2, dim=-1)[::-1] if self.up_first else h.chunk(2, dim=-1)
            y = torch.bmm(up * F.silu(gate), self.down_proj).view(-1, H)
            return y.reshape(E, -1, H).sum(dim=0)
        h = torch.bmm(x.repeat(E, 1).view(E, -1, H), self.gate_up_proj)
        gate, up = h.chunk(2, dim=-1)[::-1] if self.up_first else h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.down_proj)
        return (y * scores.transpose(0, 1).reshape(E, -1)[..., None]).sum(dim=0)


def test_bmm_moe_pattern():
    x = torch.randn(2, 3, H)
    gm = check("match_bmm_moe_pattern", Llama4StyleMoe(), (x,), matches=1, dynamic=DYN,
               other_args=(torch.randn(3, 2, H),), atol=1e-5)
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_moe_dense_mlp.default]
    assert node.kwargs["apply_routing_on_input"] is True
    check("match_bmm_moe_pattern", Llama4StyleMoe(on_input=False), (x,), matches=0, dynamic=DYN)


def test_dense_moe_pattern():
    x = torch.randn(2, 3, H)
    gm = check("match_dense_moe_pattern", Llama4StyleMoe(on_input=False), (x,), matches=1, dynamic=DYN,
               other_args=(torch.randn(1, 5, H),), atol=1e-5)
    assert gone(gm, "aten.bmm.default")
    check("match_dense_moe_pattern", Llama4StyleMoe(on_input=True), (x,), matches=0, dynamic=DYN)
