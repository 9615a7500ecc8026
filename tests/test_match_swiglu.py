"""match_swiglu_pattern on small exported modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from match_support import check, count, gone

DYN = {0: {0: "batch", 1: "seq"}}


class MLP(torch.nn.Module):
    """HF LlamaMLP, written out."""

    def __init__(self, hidden=16, inter=32, bias=False, act=F.silu):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Two(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.a, self.b = MLP(**kw), MLP(**kw)

    def forward(self, x):
        return self.b(x + self.a(x))


def test_swiglu_positive_with_and_without_bias():
    x = torch.randn(2, 5, 16)
    gm = check("match_swiglu_pattern", Two(), (x,), matches=2, dynamic=DYN, other_args=(torch.randn(3, 2, 16),),
               atol=1e-5)
    assert count(gm, "workbench.torch_swiglu_mlp.default") == 2 and gone(gm, "aten.linear.default")
    gm = check("match_swiglu_pattern", Two(bias=True), (x,), matches=2, dynamic=DYN, atol=1e-5)
    assert all(len(n.args) == 7 for n in gm.graph.nodes if "swiglu" in str(n.target))


def test_swiglu_near_miss_gelu():
    check("match_swiglu_pattern", Two(act=F.gelu), (torch.randn(2, 5, 16),), matches=0, dynamic=DYN)
