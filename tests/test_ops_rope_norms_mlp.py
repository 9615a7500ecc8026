"""Reference semantics of the RoPE, normalization, SwiGLU and linear ops, and their fake impls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import workbench.ops  # noqa: F401
from workbench.ops.rope import rotate_half

wb = torch.ops.workbench


def _cos_sin(b=2, s=5, d=8):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(s).float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)[None].expand(b, -1, -1)
    return emb.cos(), emb.sin()


def test_rope_explicit_matches_hf_formula_in_both_layouts():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _cos_sin()
    qo, ko = wb.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 1)
    c, s = cos[:, None], sin[:, None]
    torch.testing.assert_close(qo, q * c + rotate_half(q) * s)
    torch.testing.assert_close(ko, k * c + rotate_half(k) * s)
    qb, kb = wb.torch_rope_with_explicit_cos_sin(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)
    torch.testing.assert_close(qb.transpose(1, 2), qo)
    torch.testing.assert_close(kb.transpose(1, 2), ko)


def test_rope_preserves_norm_of_pairs():
    # A rotation: the norm of each (x_i, x_{i+d/2}) pair is unchanged.
    q, k = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    qo, _ = wb.torch_rope_with_explicit_cos_sin(q, k, *_cos_sin(1), 1)
    pair = lambda x: x[..., :4] ** 2 + x[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(qo), pair(q))


def test_rope_qk_interleaving_deinterleaves_then_rotates():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _cos_sin()
    qo, ko = wb.torch_rope_with_qk_interleaving(q, k, cos, sin, 1)
    q_d = q.view(2, 4, 5, 4, 2).transpose(4, 3).reshape(2, 4, 5, 8)  # DeepSeek's de-interleave
    torch.testing.assert_close(qo, q_d * cos[:, None] + rotate_half(q_d) * sin[:, None])
    assert ko.shape == k.shape


def test_rope_complex_freqs_equals_explicit_on_interleaved_pairs():
    xq, xk = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    ang = torch.randn(2, 5, 4)
    freqs = torch.polar(torch.ones_like(ang), ang)
    qo, ko = wb.torch_rope_with_complex_freqs(xq, xk, freqs, 2)
    # Pair (x0, x1) rotated by angle a: (x0 cos a - x1 sin a, x0 sin a + x1 cos a).
    x0, x1 = xq[..., 0::2], xq[..., 1::2]
    c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
    ref = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)
    torch.testing.assert_close(qo, ref)
    assert ko.shape == xk.shape and ko.dtype == xk.dtype


def test_rmsnorm_and_l2norm():
    x, w = torch.randn(2, 3, 16), torch.randn(16)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(wb.torch_rmsnorm(x, w, 1e-6), ref)
    xb = x.bfloat16()
    out = wb.torch_rmsnorm(xb, w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(wb.torch_l2norm(x, 1e-6), F.normalize(x, dim=-1), atol=1e-5, rtol=1e-5)


def test_swiglu_and_linear_simple():
    x = torch.randn(2, 3, 8)
    g, u, d = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    ref = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
    torch.testing.assert_close(wb.torch_swiglu_mlp(x, g, u, d), ref)
    bg, bu, bd = torch.randn(16), torch.randn(16), torch.randn(8)
    ref_b = F.linear(F.silu(F.linear(x, g, bg)) * F.linear(x, u, bu), d, bd)
    torch.testing.assert_close(wb.torch_swiglu_mlp(x, g, u, d, bg, bu, bd), ref_b)
    torch.testing.assert_close(wb.torch_linear_simple(x, g, bg), F.linear(x, g, bg))


def test_fake_impls_and_opcheck():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _cos_sin()
    freqs = torch.polar(torch.ones(2, 5, 4), torch.randn(2, 5, 4))
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    g, u, d = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    cases = [
        (wb.torch_rope_with_explicit_cos_sin.default, (q, k, cos, sin, 1)),
        (wb.torch_rope_with_qk_interleaving.default, (q, k, cos, sin, 1)),
        (wb.torch_rope_with_complex_freqs.default, (q.transpose(1, 2), k.transpose(1, 2), freqs, 2)),
        (wb.torch_rmsnorm.default, (x, w, 1e-5)),
        (wb.torch_l2norm.default, (x, 1e-6)),
        (wb.torch_swiglu_mlp.default, (x, g, u, d)),
        (wb.torch_linear_simple.default, (x, g)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
