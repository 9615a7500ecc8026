"""Reference semantics of the attention ops: against SDPA / explicit math, both layouts, GQA,
causal (incl. s_q < s_k), sliding window, sinks, soft-cap; fake impls; opcheck."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import workbench.ops  # noqa: F401
from workbench.ops.attention import visible_keys

wb = torch.ops.workbench


def _qkv(b=2, n=4, n_kv=2, s_q=5, s_k=5, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, s_q, d, generator=g), torch.randn(b, n_kv, s_k, d, generator=g),
            torch.randn(b, n_kv, s_k, d, generator=g))


def _reference(q, k, v, keep=None, scale=None, sinks=None, cap=None):
    """Textbook attention in float64 (bnsd, repeated KV)."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return (p @ v).float()


def test_causal_gqa_matches_reference_and_sdpa():
    q, k, v = _qkv()
    out = wb.torch_attention(q, k, v, is_causal=True)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, kk, vv, is_causal=True))


def test_bsnd_layout_equals_bnsd():
    q, k, v = _qkv()
    ref = wb.torch_attention(q, k, v, is_causal=True, scale=0.3)
    out = wb.torch_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.3,
        layout="bsnd",
    )
    assert out.shape == (2, 5, 4, 8)
    torch.testing.assert_close(out.transpose(1, 2), ref)


def test_causal_is_bottom_right_aligned_for_shorter_queries():
    q, k, v = _qkv(s_q=2, s_k=6)
    out = wb.torch_attention(q, k, v, is_causal=True)
    keep = visible_keys(2, 6, torch.device("cpu"), True, None)
    assert keep.tolist() == [[True] * 5 + [False], [True] * 6]
    torch.testing.assert_close(out, _reference(q, k, v, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 3, 100])
def test_sliding_window(window):
    q, k, v = _qkv(s_q=6, s_k=6)
    out = wb.torch_attention(q, k, v, is_causal=True, sliding_window=window)
    i = torch.arange(6)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    torch.testing.assert_close(out, _reference(q, k, v, keep), atol=1e-5, rtol=1e-5)


def test_sinks_and_logit_cap_and_masks():
    q, k, v = _qkv()
    sinks = torch.randn(4)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    out = wb.torch_attention(q, k, v, is_causal=True, sinks=sinks, logit_cap=2.0, scale=0.5)
    ref = _reference(q, k, v, keep, scale=0.5, sinks=sinks, cap=2.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Boolean mask (True = attend) and the equivalent additive float mask.
    bool_mask = torch.rand(2, 1, 5, 5) > 0.3
    bool_mask[..., 0] = True
    out_b = wb.torch_attention(q, k, v, attn_mask=bool_mask)
    torch.testing.assert_close(out_b, _reference(q, k, v, bool_mask), atol=1e-5, rtol=1e-5)
    float_mask = torch.zeros(2, 1, 5, 5).masked_fill(~bool_mask, float("-inf"))
    torch.testing.assert_close(wb.torch_attention(q, k, v, attn_mask=float_mask), out_b)


def test_bad_arguments_raise():
    q, k, v = _qkv(n=3, n_kv=2)
    with pytest.raises(ValueError, match="multiple"):
        wb.torch_attention(q, k, v)
    with pytest.raises(ValueError, match="layout"):
        wb.torch_attention(*_qkv(), layout="sbnd")


def test_sdpa_op_and_repeat_kv():
    q, k, v = _qkv()
    out = wb.torch_attention_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, wb.torch_attention(q, k, v, is_causal=True))
    rep = wb.torch_attention_repeat_kv(k, 2)
    ref = k[:, :, None].expand(2, 2, 2, 5, 8).reshape(2, 4, 5, 8)  # HF repeat_kv
    assert torch.equal(rep, ref)
    assert wb.torch_attention_repeat_kv(k, 1).data_ptr() != k.data_ptr()  # never aliases


def test_fake_impls_and_opcheck():
    q, k, v = _qkv()
    for args, kwargs in [
        ((q, k, v), {"is_causal": True}),
        ((q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), {"layout": "bsnd"}),
        ((q, k, v), {"is_causal": True, "sliding_window": 2, "sinks": torch.zeros(4)}),
    ]:
        torch.library.opcheck(wb.torch_attention.default, args, kwargs)
    torch.library.opcheck(wb.torch_attention_sdpa.default, (q, k, v), {"enable_gqa": True})
    torch.library.opcheck(wb.torch_attention_repeat_kv.default, (k, 2))
