"""match_attention_layout, match_rope_layout and eliminate_redundant_transposes."""

from __future__ import annotations

import pytest
import torch

from match_support import check, count, export, gone, run
from workbench.pipeline.transforms.attention.layout import MatchRopeLayoutConfig

wb = torch.ops.workbench
B, S, D = 2, 5, 8
QKV_DYN = {i: {0: "batch", 2: "seq"} for i in range(3)}


def qkv(b=B, s=S):
    return torch.randn(b, 4, s, D), torch.randn(b, 2, s, D), torch.randn(b, 2, s, D)


def attention_bnsd(q, k, v):
    return wb.torch_attention.default(q, k, v, is_causal=True, scale=0.3)


def _layouts(gm):
    return [n.kwargs.get("layout", "bnsd") for n in gm.graph.nodes if n.target is wb.torch_attention.default]


def test_attention_layout_to_bsnd_and_back():
    gm = check("match_attention_layout", attention_bnsd, qkv(), matches=1, dynamic=QKV_DYN,
               other_args=qkv(3, 7), attn_layout="bsnd")
    assert _layouts(gm) == ["bsnd"] and count(gm, "aten.transpose.int") == 4
    # Already in the target layout: a no-op.
    check("match_attention_layout", attention_bnsd, qkv(), matches=0, dynamic=QKV_DYN, attn_layout="bnsd")


def test_attention_layout_config_is_required_and_validated():
    from workbench.pipeline.transforms.attention.layout import MatchAttentionLayoutConfig

    with pytest.raises(Exception):
        MatchAttentionLayoutConfig(stage="pattern_matcher")
    with pytest.raises(Exception):
        MatchAttentionLayoutConfig(stage="pattern_matcher", attn_layout="sbnd")
    with pytest.raises(Exception):
        MatchRopeLayoutConfig(stage="pattern_matcher", expected_layout="sbnd")


def rope_bnsd(q, k, cos, sin):
    out = wb.torch_rope_with_explicit_cos_sin.default(q, k, cos, sin, 1)
    return out[0] * 2, out[1]


def _rope_inputs(b=B, s=S):
    return torch.randn(b, 4, s, D), torch.randn(b, 2, s, D), torch.randn(b, s, D), torch.randn(b, s, D)


ROPE_DYN = {0: {0: "batch", 2: "seq"}, 1: {0: "batch", 2: "seq"}, 2: {0: "batch", 1: "seq"}, 3: {0: "batch", 1: "seq"}}


def test_rope_layout():
    gm = check("match_rope_layout", rope_bnsd, _rope_inputs(), matches=1, dynamic=ROPE_DYN,
               other_args=_rope_inputs(3, 4), expected_layout="bsnd")
    (node,) = [n for n in gm.graph.nodes if "rope" in str(n.target)]
    assert node.args[4] == 2
    check("match_rope_layout", rope_bnsd, _rope_inputs(), matches=0, dynamic=ROPE_DYN,
          expected_layout="bnsd")


def test_eliminate_redundant_transposes():
    def fn(x):
        a = x.transpose(1, 2).transpose(2, 1)  # same pair of dims, either order
        b = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[1], -1).transpose(1, 2)
        return a + 1, b * 2

    x = torch.randn(B, S, 4, D)
    gm = check("eliminate_redundant_transposes", fn, (x,), matches=2, dynamic={0: {0: "batch", 1: "seq"}},
               other_args=(torch.randn(3, 7, 4, D),))
    assert gone(gm, "aten.transpose.int")


def test_eliminate_redundant_transposes_near_miss():
    def fn(x):
        return x.transpose(1, 2).transpose(0, 1), x.transpose(1, 2).reshape(x.shape[0], -1).sum(-1)

    check("eliminate_redundant_transposes", fn, (torch.randn(B, S, 4, D),), matches=0,
          dynamic={0: {0: "batch", 1: "seq"}})


def test_layout_chain_leaves_no_transposes():
    """view -> transpose -> rope -> attention, relaid out to bsnd, loses every transpose."""

    def block(x, cos, sin):
        b, s = x.shape[:2]
        q = x.view(b, s, 4, D).transpose(1, 2)
        k = x[..., : 2 * D].reshape(b, s, 2, D).transpose(1, 2)
        v = (x[..., : 2 * D] * 2).reshape(b, s, 2, D).transpose(1, 2)
        q, k = wb.torch_rope_with_explicit_cos_sin.default(q, k, cos, sin, 1)
        out = wb.torch_attention.default(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1)

    args = (torch.randn(B, S, 4 * D), torch.randn(B, S, D), torch.randn(B, S, D))
    gm = export(block, args, {0: {0: "batch", 1: "seq"}, 1: {0: "batch", 1: "seq"}, 2: {0: "batch", 1: "seq"}})
    ref = gm(*args)
    gm, _ = run("match_attention_layout", gm, attn_layout="bsnd")
    gm, _ = run("match_rope_layout", gm, expected_layout="bsnd")
    gm, info = run("eliminate_redundant_transposes", gm)
    # q and k: two pairs each (around rope, around attention); v and the output: one each
    assert info.num_matches == 6 and gone(gm, "aten.transpose.int")
    torch.testing.assert_close(gm(*args), ref)
