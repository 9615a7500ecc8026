"""match_rmsnorm_pattern / match_l2norm_pattern on small exported modules."""

from __future__ import annotations

import torch

from match_support import check, count, gone

DYN = {0: {0: "batch", 1: "seq"}}


class RMSNorm(torch.nn.Module):
    """HF LlamaRMSNorm, written out."""

    def __init__(self, hidden=16, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class TwoNorms(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a, self.b = RMSNorm(dtype=dtype), RMSNorm(eps=1e-5, dtype=dtype)
        self.proj = torch.nn.Linear(16, 16, dtype=dtype)

    def forward(self, x):
        h = self.proj(self.a(x)) + x  # residual reads x, as a decoder layer does
        return self.b(h)


def test_rmsnorm_matches_with_casts_and_keeps_eps():
    x = torch.randn(2, 5, 16)
    gm = check("match_rmsnorm_pattern", TwoNorms(), (x,), matches=2, dynamic=DYN,
               other_args=(torch.randn(3, 7, 16),))
    assert count(gm, "workbench.torch_rmsnorm.default") == 2
    assert gone(gm, "aten.rsqrt.default")
    eps = sorted(n.args[2] for n in gm.graph.nodes if "rmsnorm" in str(n.target))
    assert eps == [1e-6, 1e-5]


def test_rmsnorm_matches_in_bf16():
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    check("match_rmsnorm_pattern", TwoNorms(torch.bfloat16), (x,), matches=2, dynamic=DYN, atol=0)


def test_rmsnorm_without_casts():
    w = torch.randn(16)
    check("match_rmsnorm_pattern", lambda x: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
          (torch.randn(2, 5, 16),), matches=1, dynamic=DYN)


def test_rmsnorm_near_misses_are_left_alone():
    w = torch.randn(16)

    def over_dim0(x):  # statistics over the wrong dim
        h = x.to(torch.float32)
        return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)

    def other_cast(x):  # casts back to another dtype than the input's
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.float16) * w.half()

    check("match_rmsnorm_pattern", over_dim0, (torch.randn(2, 5, 16),), matches=0, dynamic=DYN)
    check("match_rmsnorm_pattern", other_cast, (torch.randn(2, 5, 16),), matches=0, dynamic=DYN, atol=1e-3)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def test_l2norm_positive_and_near_miss():
    x = torch.randn(2, 5, 4, 16)
    dyn = {0: {0: "batch", 1: "seq"}}
    gm = check("match_l2norm_pattern", lambda q, k: (l2norm(q), l2norm(k, 1e-5)), (x, x + 1),
               matches=2, dynamic={**dyn, 1: {0: "batch", 1: "seq"}})
    assert count(gm, "workbench.torch_l2norm.default") == 2
    mean_not_sum = lambda x: x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6)  # noqa: E731
    check("match_l2norm_pattern", mean_not_sum, (x,), matches=0, dynamic=dyn)
