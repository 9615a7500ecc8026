"""match_repeat_kv, match_eager_attention (plain, soft-capped, with sinks), match_sdpa_to_torch_attention
and match_grouped_attention on small exported modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from match_support import check, count, export, gone, run
from workbench.pipeline.matcher.masks import MaskKind, classify_mask

wb = torch.ops.workbench
B, S, D = 2, 6, 8
QKV_DYN = {i: {0: "batch", 2: "seq"} for i in range(3)}


def repeat_kv(x, n_rep):
    """HF repeat_kv, written out."""
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d)


def hf_causal_mask(q):
    """A mask the way transformers' sdpa_mask builds it: kv_idx <= q_idx from two aranges."""
    s = q.shape[2]
    q_idx = torch.arange(s)[None, None, :, None]
    kv_idx = torch.arange(s)[None, None, None, :]
    return (kv_idx <= q_idx).expand(q.shape[0], -1, s, s)


def hf_sliding_mask(q, window):
    s = q.shape[2]
    q_idx = torch.arange(s)[None, None, :, None]
    kv_idx = torch.arange(s)[None, None, None, :]
    return ((kv_idx > q_idx - window) & (kv_idx <= q_idx)).expand(q.shape[0], -1, s, s)


def qkv(n=4, n_kv=2, s=S, b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, s, D, generator=g), torch.randn(b, n_kv, s, D, generator=g),
            torch.randn(b, n_kv, s, D, generator=g))


def gqa_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=hf_causal_mask(q), scale=0.3)


# ------------------------------------------------------------------------------ repeat_kv


def test_repeat_kv_positive():
    gm = check("match_repeat_kv", lambda k, v: (repeat_kv(k, 2) * 2, repeat_kv(v, 3)), qkv()[1:],
               matches=2, dynamic={0: {0: "batch", 2: "seq"}, 1: {0: "batch", 2: "seq"}},
               other_args=qkv(b=3, s=9)[1:])
    assert count(gm, "workbench.torch_attention_repeat_kv.default") == 2
    assert gone(gm, "aten.expand.default")
    reps = sorted(n.args[1] for n in gm.graph.nodes if "repeat_kv" in str(n.target))
    assert reps == [2, 3]


def test_repeat_kv_near_miss_repeats_along_the_sequence():
    def along_seq(k):  # unsqueeze after the sequence dim: repeats positions, not heads
        b, n, s, d = k.shape
        return k[:, :, :, None, :].expand(b, n, s, 2, d).reshape(b, n, s * 2, d)

    # Not a bnsd repeat of heads. The same ops are the bsnd spelling of one (dim 2 is heads there),
    # which match_repeat_kv takes -- exactly: transpose, repeat dim 1, transpose back.
    gm = export(along_seq, qkv()[1:2], {0: {0: "batch", 2: "seq"}})
    _, info = run("match_repeat_kv", gm)
    assert info.details["matches"] == {"repeat_kv": 0, "repeat_kv_bsnd": 1}


# ------------------------------------------------------------------------------ eager attention


def eager_attention(q, k, v, mask):
    """HF eager_attention_forward, written out (after repeat_kv)."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


def test_eager_attention_positive():
    q, k, v = qkv(n_kv=4)
    mask = torch.zeros(B, 1, S, S).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    dyn = {**QKV_DYN, 3: {0: "batch", 2: "seq", 3: "seq"}}
    gm = check("match_eager_attention", eager_attention, (q, k, v, mask), matches=1, dynamic=dyn, atol=1e-5)
    assert count(gm, "workbench.torch_attention_sdpa.default") == 1
    assert gone(gm, "aten.softmax.int")
    div = lambda q, k, v: torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) / 4.0, dim=-1, dtype=torch.float32).to(q.dtype), v)  # noqa: E501,E731
    check("match_eager_attention", div, (q, k, v), matches=1, dynamic=QKV_DYN, atol=1e-5)


def test_eager_attention_near_miss_softmax_over_queries():
    def over_queries(q, k, v):
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-2, dtype=torch.float32)
        return torch.matmul(w.to(q.dtype), v)

    check("match_eager_attention", over_queries, qkv(n_kv=4), matches=0, dynamic=QKV_DYN)


def hf_eager_mask(q, window=None):
    """HF's additive eager mask: 0 where visible, finfo(float32).min where hidden, [b, 1, s, s]."""
    s = q.shape[2]
    q_idx, kv_idx = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = kv_idx <= q_idx
    if window is not None:
        keep = keep & (kv_idx > q_idx - window)
    return torch.where(keep, torch.zeros(()), torch.finfo(torch.float32).min)[None, None].expand(q.shape[0], 1, s, s)


def softcapped_eager(q, k, v, cap_in=5.0, cap_out=5.0):
    """Gemma 2's eager_attention_forward with a sliding window of 3, written out."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3
    w = w / cap_in
    w = torch.tanh(w)
    w = w * cap_out
    w = w + hf_eager_mask(q, 3)
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


def sink_eager(q, k, v, sinks, keep=slice(None, -1), cast=True):
    """gpt-oss's eager_attention_forward, written out; ``keep`` = the softmax columns kept,
    ``cast``: the final cast to v's dtype (transformers 5.23 has it, older releases do not)."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + hf_eager_mask(q)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([w, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., keep]
    probs = F.dropout(probs, p=0.0, training=False)
    return torch.matmul(probs.to(v.dtype) if cast else probs, v)


def test_softcapped_eager_attention_becomes_torch_attention_with_cap_and_window():
    gm = check("match_eager_attention", softcapped_eager, qkv(n_kv=4), matches=1, dynamic=QKV_DYN,
               other_args=qkv(n_kv=4, b=3, s=10), atol=1e-5)
    node = _attention_kwargs(gm)
    assert node.kwargs["logit_cap"] == 5.0 and node.kwargs["scale"] == 0.3
    assert node.kwargs["sliding_window"] == 3 and node.kwargs["is_causal"] is True
    assert node.kwargs["attn_mask"] is None  # the finfo.min additive mask was only causal + window
    for name in ("aten.tanh.default", "aten.softmax.int", "aten.where.ScalarOther"):
        assert gone(gm, name), name


def test_softcapped_eager_near_miss_different_caps():
    fn = lambda q, k, v: softcapped_eager(q, k, v, cap_in=5.0, cap_out=4.0)  # noqa: E731  (not a soft-cap)
    check("match_eager_attention", fn, qkv(n_kv=4), matches=0, dynamic=QKV_DYN)


def test_sink_eager_attention_becomes_torch_attention_with_sinks():
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    gm = check("match_eager_attention", sink_eager, (*qkv(n_kv=4), sinks), matches=1, dynamic=QKV_DYN,
               other_args=(*qkv(n_kv=4, b=3, s=9), sinks), atol=1e-5)
    node = _attention_kwargs(gm)
    assert node.kwargs["sinks"].op == "placeholder" and node.kwargs["scale"] == 0.25
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert node.kwargs["sliding_window"] is None and node.kwargs.get("logit_cap") is None
    assert gone(gm, "aten.cat.default") and gone(gm, "aten.max.dim")
    no_cast = lambda q, k, v, sinks: sink_eager(q, k, v, sinks, cast=False)  # noqa: E731
    gm = check("match_eager_attention", no_cast, (*qkv(n_kv=4), sinks), matches=1, dynamic=QKV_DYN, atol=1e-5)
    assert _attention_kwargs(gm).kwargs["sinks"].op == "placeholder"


def max_subtracted_eager(q, k, v, cast=True):
    """MiMo-V2-Flash's eager_attention_forward on a layer without sinks: the row max subtracted,
    softmax in the logits' dtype."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + hf_eager_mask(q)
    w = w - w.max(dim=-1, keepdim=True).values
    probs = F.dropout(F.softmax(w, dim=-1, dtype=w.dtype), p=0.0, training=False)
    return torch.matmul(probs.to(v.dtype) if cast else probs, v)


def test_max_subtracted_eager_attention_becomes_torch_attention():
    gm = check("match_eager_attention", max_subtracted_eager, qkv(n_kv=4), matches=1, dynamic=QKV_DYN,
               other_args=qkv(n_kv=4, b=3, s=9), atol=1e-5)
    node = _attention_kwargs(gm)
    assert node.kwargs["scale"] == 0.25 and node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert node.kwargs.get("sinks") is None
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.max.dim, torch.ops.aten.softmax.int)]
    # a max taken over another dim is not a softmax shift: left alone
    def wrong_dim(q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + hf_eager_mask(q)
        w = w - w.max(dim=-2, keepdim=True).values
        return torch.matmul(F.softmax(w, dim=-1, dtype=w.dtype), v)

    check("match_eager_attention", wrong_dim, qkv(n_kv=4), matches=0, dynamic=QKV_DYN)


def lse_sink_eager(q, k, v, sinks, plus=False):
    """Granite-SWA's eager_attention_forward: the sink as an output scale sigmoid(lse - sink)
    (``plus``: sigmoid(lse + sink), another computation)."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + hf_eager_mask(q)
    lse, sink = torch.logsumexp(w, dim=-1), sinks.view(1, -1, 1)
    sink_scale = (lse + sink if plus else lse - sink).to(torch.float32).sigmoid()
    probs = F.dropout(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), p=0.0, training=False)
    out = torch.matmul(probs, v)
    return out * sink_scale.unsqueeze(-1).to(out.dtype)


def test_lse_sink_eager_attention_becomes_torch_attention_with_sinks():
    """The output-scale spelling equals gpt-oss's sink column: matched to torch_attention(sinks=...)."""
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6))
    gm = check("match_eager_attention", lse_sink_eager, (*qkv(n_kv=4), sinks), matches=1, dynamic=QKV_DYN,
               other_args=(*qkv(n_kv=4, b=3, s=9), sinks), atol=1e-5)
    node = _attention_kwargs(gm)
    assert node.kwargs["sinks"].op == "placeholder" and node.kwargs["is_causal"] is True
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.logsumexp.default, torch.ops.aten.sigmoid.default)]
    # the same against the sink-column spelling on the same inputs
    q, k, v = qkv(n_kv=4)
    torch.testing.assert_close(lse_sink_eager(q, k, v, sinks), sink_eager(q, k, v, sinks), atol=1e-6, rtol=1e-5)
    # sigmoid(lse + sink) is another computation: left alone
    plus = lambda q, k, v, sinks: lse_sink_eager(q, k, v, sinks, plus=True)  # noqa: E731
    check("match_eager_attention", plus, (*qkv(n_kv=4), sinks), matches=0, dynamic=QKV_DYN)


def test_sink_eager_near_miss_drops_the_wrong_column():
    fn = lambda q, k, v, sinks: sink_eager(q, k, v, sinks, keep=slice(1, None))  # noqa: E731
    check("match_eager_attention", fn, (*qkv(n_kv=4), torch.randn(4)), matches=0, dynamic=QKV_DYN)


def test_classify_mask_reads_additive_eager_masks():
    for window, kind in ((None, MaskKind(is_causal=True)), (3, MaskKind(is_causal=True, sliding_window=3))):
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=hf_eager_mask(q, window))  # noqa: E731
        gm = export(fn, qkv(n_kv=4), QKV_DYN)
        (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
        assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) == kind

    def soft_mask(q, k, v):  # -1e4 where hidden: a bias, not a hard mask (softmax weight not exactly 0)
        s = q.shape[2]
        keep = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, torch.zeros(()), -1e4))

    gm = export(soft_mask, qkv(n_kv=4), QKV_DYN)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) is None


# ------------------------------------------------------------------------------ sdpa -> torch_attention


def _attention_kwargs(gm):
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_attention.default]
    return node


def test_sdpa_with_hf_causal_mask_and_repeat_kv_becomes_native_gqa():
    gm = export(gqa_sdpa, qkv(), QKV_DYN)
    run("match_repeat_kv", gm)
    ref = gm(*qkv(seed=1))
    gm, info = run("match_sdpa_to_torch_attention", gm)
    assert info.num_matches == 1
    node = _attention_kwargs(gm)
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert node.kwargs["scale"] == 0.3 and node.kwargs["layout"] == "bnsd"
    assert node.args[1].op == "placeholder"  # un-repeated K
    for name in ("aten.scaled_dot_product_attention.default", "aten.le.Tensor", "aten.arange.default",
                 "workbench.torch_attention_repeat_kv.default"):
        assert gone(gm, name), name
    torch.testing.assert_close(gm(*qkv(seed=1)), ref)
    torch.testing.assert_close(gm(*qkv(b=3, s=11, seed=2)), gqa_sdpa(*qkv(b=3, s=11, seed=2)))
    torch.export.export(gm, qkv(), strict=False)


def test_sdpa_without_repeat_kv_matched_directly():
    check("match_sdpa_to_torch_attention", gqa_sdpa, qkv(), matches=1, dynamic=QKV_DYN,
          other_args=qkv(b=3, s=9))
    plain = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    gm = check("match_sdpa_to_torch_attention", plain, qkv(n_kv=4), matches=1, dynamic=QKV_DYN)
    assert _attention_kwargs(gm).kwargs["is_causal"] is True


def test_sliding_window_mask_becomes_sliding_window():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=hf_sliding_mask(q, 3))  # noqa: E731
    gm = check("match_sdpa_to_torch_attention", fn, qkv(n_kv=4), matches=1, dynamic=QKV_DYN,
               other_args=qkv(n_kv=4, s=10))
    node = _attention_kwargs(gm)
    assert node.kwargs["sliding_window"] == 3 and node.kwargs["attn_mask"] is None


def test_input_dependent_mask_is_kept():
    def padded(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] & hf_causal_mask(q))

    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :2] = False
    dyn = {**QKV_DYN, 3: {0: "batch", 1: "seq"}}
    gm = check("match_sdpa_to_torch_attention", padded, (*qkv(n_kv=4), keep), matches=1, dynamic=dyn)
    node = _attention_kwargs(gm)
    assert node.kwargs["attn_mask"] is not None and not node.kwargs.get("is_causal", False)


def test_classify_mask_rejects_non_causal_position_masks():
    def prefix_lm(q, k, v):  # bidirectional over the first two positions: not causal
        s = q.shape[2]
        q_idx, kv_idx = torch.arange(s)[None, None, :, None], torch.arange(s)[None, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) | (kv_idx < 2))

    gm = export(prefix_lm, qkv(n_kv=4), QKV_DYN)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) is None
    gm = export(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=hf_causal_mask(q)),
                qkv(n_kv=4), QKV_DYN)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) == MaskKind(is_causal=True)


def test_sdpa_near_miss_three_dim_inputs():
    x = torch.randn(2, S, D)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    check("match_sdpa_to_torch_attention", fn, (x, x + 1, x - 1), matches=0,
          dynamic={i: {0: "batch", 1: "seq"} for i in range(3)})


def test_torch_attention_sdpa_is_lowered_too():
    fn = lambda q, k, v: wb.torch_attention_sdpa.default(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)  # noqa: E731
    gm = check("match_sdpa_to_torch_attention", fn, qkv(), matches=1, dynamic=QKV_DYN)
    assert gone(gm, "workbench.torch_attention_sdpa.default")


# ------------------------------------------------------------------------------ grouped attention


def test_grouped_attention_drops_repeat_kv():
    def fn(q, k, v):
        k2, v2 = wb.torch_attention_repeat_kv.default(k, 2), wb.torch_attention_repeat_kv.default(v, 2)
        return wb.torch_attention.default(q, k2, v2, is_causal=True)

    gm = check("match_grouped_attention", fn, qkv(), matches=1, dynamic=QKV_DYN, other_args=qkv(b=3, s=4))
    assert gone(gm, "workbench.torch_attention_repeat_kv.default")
    raw = lambda q, k, v: wb.torch_attention.default(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)  # noqa: E731
    gm = check("match_grouped_attention", raw, qkv(), matches=1, dynamic=QKV_DYN)
    assert gone(gm, "aten.expand.default")


def test_grouped_attention_near_miss_only_keys_repeated():
    def fn(q, k, v):
        return wb.torch_attention.default(q, wb.torch_attention_repeat_kv.default(k, 2), v, is_causal=True)

    q, k, _ = qkv()
    check("match_grouped_attention", fn, (q, k, torch.randn(B, 4, S, D)), matches=0, dynamic=QKV_DYN)
