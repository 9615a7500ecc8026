"""match_rope_pattern on small exported modules (rotate-half, DeepSeek interleaved, complex)."""

from __future__ import annotations

import torch

from match_support import check, count, gone

B, S, D = 2, 5, 8
DYN4 = {0: {0: "batch", 2: "seq"}, 1: {0: "batch", 2: "seq"}, 2: {0: "batch", 1: "seq"}, 3: {0: "batch", 1: "seq"}}


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """HF Llama apply_rotary_pos_emb, written out."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def inputs(b=B, s=S, bsnd=False):
    q, k = torch.randn(b, 4, s, D), torch.randn(b, 2, s, D)
    if bsnd:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    ang = torch.randn(b, s, D // 2)
    emb = torch.cat([ang, ang], -1)
    return q, k, emb.cos(), emb.sin()


def test_rotate_half_rope_bnsd_and_bsnd():
    gm = check("match_rope_pattern", apply_rotary_pos_emb, inputs(), matches=1, dynamic=DYN4,
               other_args=inputs(3, 7))
    assert count(gm, "workbench.torch_rope_with_explicit_cos_sin.default") == 1
    assert gone(gm, "aten.cat.default")
    dyn = {0: {0: "batch", 1: "seq"}, 1: {0: "batch", 1: "seq"}, 2: {0: "batch", 1: "seq"}, 3: {0: "batch", 1: "seq"}}
    gm = check("match_rope_pattern", lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, 2),
               inputs(bsnd=True), matches=1, dynamic=dyn)
    (node,) = [n for n in gm.graph.nodes if "rope" in str(n.target)]
    assert node.args[4] == 2


def test_rope_near_misses():
    def sign_flipped(q, k, cos, sin):  # cat((x2, -x1)): rotates the other way
        flip = lambda x: torch.cat((x[..., D // 2 :], -x[..., : D // 2]), dim=-1)  # noqa: E731
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + flip(q) * s, k * c + flip(k) * s

    def partial(q, k, cos, sin):  # rotate-half over a 3/5 split: not a rotation pair
        rot = lambda x: torch.cat((-x[..., 3:], x[..., :3]), dim=-1)  # noqa: E731
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    check("match_rope_pattern", sign_flipped, inputs(), matches=0, dynamic=DYN4)
    check("match_rope_pattern", partial, inputs(), matches=0, dynamic=DYN4)


def deepseek_rope(q, k, cos, sin, unsqueeze_dim=1):
    """HF DeepseekV3 apply_rotary_pos_emb_interleave, written out."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def test_qk_interleaving_rope():
    gm = check("match_rope_pattern", deepseek_rope, inputs(), matches=1, dynamic=DYN4,
               other_args=inputs(3, 6))
    assert count(gm, "workbench.torch_rope_with_qk_interleaving.default") == 1
    # not also (or instead) the plain form: a count of a created op, not a "gone" (the name is checked)
    assert count(gm, "workbench.torch_rope_with_explicit_cos_sin.default") == 0


def complex_rope(xq, xk, freqs_cis):
    """Meta Llama / HF Llama4 apply_rotary_emb, written out."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def test_complex_freqs_rope():
    xq, xk = torch.randn(B, S, 4, D), torch.randn(B, S, 2, D)
    freqs = torch.polar(torch.ones(B, S, D // 2), torch.randn(B, S, D // 2))
    dyn = {0: {0: "batch", 1: "seq"}, 1: {0: "batch", 1: "seq"}, 2: {0: "batch", 1: "seq"}}
    gm = check("match_rope_pattern", complex_rope, (xq, xk, freqs), matches=1, dynamic=dyn)
    (node,) = [n for n in gm.graph.nodes if "complex_freqs" in str(n.target)]
    assert node.args[3] == 2  # bsnd
