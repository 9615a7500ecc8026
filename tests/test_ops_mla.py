"""The MLA ops: ``torch_mla`` against HF's DeepSeek-V2 attention, the absorbed form against the
expanded one, and ``torch_cached_mla`` (paged latent cache) against the uncached op.

Tolerance: fp32 with O(1) activations. The absorbed form reassociates each score's sum (over the
latent rank r instead of the head dim dn) and the value projection (after the softmax instead of
before), and SDPA vs an explicit softmax sums in other orders: a few ulps apart (~1e-6 absolute
seen). 1e-5 leaves margin, while a wrong page, a stale or missing key, a mis-split kv_b_proj
(k and v parts swapped, heads mixed) moves outputs by O(0.1).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import workbench.ops.mla  # noqa: F401
from workbench.models.canonical.mla import deepseek_v2_attention_forward
from workbench.ops.mla.torch_mla import mla_absorbed, mla_expanded

wb = torch.ops.workbench
TOL = dict(atol=1e-5, rtol=1e-5)
N, DN, DR, R, DV = 4, 16, 8, 32, 12  # dv != dn: a swapped k/v split cannot pass


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N * (DN + DV), R, generator=g) / math.sqrt(R)


def _tokens(b, s, seed=1):
    """q_nope [b, s, n, dn], q_pe [b, s, n, dr], latent [b, s, r], kpe [b, s, 1, dr], all O(1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, N, DN, generator=g), torch.randn(b, s, N, DR, generator=g),
            torch.randn(b, s, R, generator=g), torch.randn(b, s, 1, DR, generator=g))


# ------------------------------------------------------------------------------ uncached


def test_torch_mla_matches_hf_deepseek_v2_attention():
    """The canonical forward (torch_mla inside) == HF's DeepseekV2Attention on the same weights,
    with and without the low-rank query path."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding

    from workbench.models.tiny_families.mla import MLA_SIZES

    for q_lora_rank in (None, 24):
        cfg = DeepseekV2Config(**MLA_SIZES, q_lora_rank=q_lora_rank)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        att = DeepseekV2Attention(cfg, layer_idx=0).eval()
        for p in att.parameters():  # O(1) activations: default init leaves the norms at 1 and linears small
            torch.nn.init.normal_(p, std=0.3)
        h = torch.randn(2, 9, cfg.hidden_size)
        pos = torch.arange(3, 12)[None].expand(2, 9)  # not starting at 0: the rope must use the positions
        freqs = DeepseekV2RotaryEmbedding(cfg)(h, pos)
        with torch.no_grad():
            ref, _ = att(hidden_states=h, attention_mask=None, position_embeddings=freqs)
            out, _ = deepseek_v2_attention_forward(att, hidden_states=h, attention_mask=None, position_embeddings=freqs)
        assert ref.abs().mean() > 0.1  # not a degenerate comparison
        torch.testing.assert_close(out, ref, **TOL)


def test_torch_mla_is_causal_expanded_attention():
    """Against attention written out by hand (per-head K = [W_k c, kpe], V = W_v c, causal softmax)."""
    w = _weights()
    qn, qp, lat, kpe = _tokens(2, 7)
    out = wb.torch_mla(qn, qp, lat, kpe, w, scale=0.3)
    assert out.shape == (2, 7, N, DV) and out.is_contiguous()
    wk = w.view(N, DN + DV, R)
    k = torch.cat([torch.einsum("bsr,ndr->bsnd", lat, wk[:, :DN]), kpe.expand(2, 7, N, DR)], -1)
    v = torch.einsum("bsr,ndr->bsnd", lat, wk[:, DN:])
    q = torch.cat([qn, qp], -1)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * 0.3
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v)
    torch.testing.assert_close(out, ref, **TOL)
    # default scale: 1 / sqrt(dn + dr)
    default = wb.torch_mla(qn, qp, lat, kpe, w, scale=(DN + DR) ** -0.5)
    torch.testing.assert_close(wb.torch_mla(qn, qp, lat, kpe, w), default)


def test_absorbed_equals_expanded():
    """Scores against the latents directly (key projection absorbed into the query) == expanded K/V,
    under an arbitrary visibility mask (every query keeps at least one key)."""
    w = _weights()
    qn, qp, _, _ = _tokens(3, 4, seed=2)
    _, _, lat, kpe = _tokens(3, 10, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(3, 4, 10, generator=g) < 0.6
    keep[..., 0] = True
    exp = mla_expanded(qn, qp, lat, kpe[:, :, 0], w, keep, 0.25)
    absd = mla_absorbed(qn, qp, lat, kpe[:, :, 0], w, keep, 0.25)
    assert absd.dtype == qn.dtype and absd.shape == (3, 4, N, DV)
    torch.testing.assert_close(absd, exp, **TOL)


def test_fake_shapes_and_bad_inputs():
    w = _weights()
    with FakeTensorMode():
        qn, qp = torch.empty(2, 5, N, DN), torch.empty(2, 5, N, DR)
        lat, kpe = torch.empty(2, 5, R), torch.empty(2, 5, 1, DR)
        assert wb.torch_mla(qn, qp, lat, kpe, torch.empty(N * (DN + DV), R)).shape == (2, 5, N, DV)
    qn, qp, lat, kpe = _tokens(1, 3)
    with pytest.raises(ValueError, match="kv_b_proj_weight must be"):
        wb.torch_mla(qn, qp, lat, kpe, w[:, :-1])
    with pytest.raises(ValueError, match="one head"):
        wb.torch_mla(qn, qp, lat, kpe.expand(1, 3, 2, DR), w)


# ------------------------------------------------------------------------------ cached


class PagedRun:
    """Drives torch_cached_mla over steps of a mixed batch, one page table row per sequence."""

    def __init__(self, w, page_size=4, num_pages=24, max_pages=6):
        self.w, self.page_size, self.max_pages = w, page_size, max_pages
        self.cache = torch.full((num_pages, page_size, R + DR), float("nan"))  # unwritten slots: NaN
        self.pages = {}  # sequence -> its page ids

    def step(self, items, tokens):
        """items: [(seq, input_pos, n_new)], prefills first; tokens: seq -> its full uncached inputs.
        Returns {seq: output rows [n_new, N, DV]}."""
        num_prefill = sum(1 for _, _, n in items if n > 1)  # this test's prefills all have >1 token
        assert all(n > 1 for _, _, n in items[:num_prefill]), "prefills first"
        rows = [torch.tensor(self.pages[s] + [0] * (self.max_pages - len(self.pages[s]))) for s, _, _ in items]
        parts = [[x[0, p: p + n] for x in tokens[s]] for s, p, n in items]
        flat = [torch.cat([pt[j] for pt in parts])[None] for j in range(4)]
        out = wb.torch_cached_mla(*flat, self.w, self.cache,
                                  torch.tensor([n for _, _, n in items], dtype=torch.int32),
                                  torch.tensor([p for _, p, _ in items], dtype=torch.int32),
                                  torch.stack(rows).int(), num_prefill, 0.3)
        res, a = {}, 0
        for s, _, n in items:
            res[s] = out[0, a: a + n]
            a += n
        return res


def test_cached_matches_uncached_chunked_prefill_mixed_decode_reused_pages():
    """Sequences A (11 tokens), B (7), C (6), then D (8) on B's pages once B is done: prefill,
    chunked prefill, decode rows beside prefills, shuffled non-contiguous pages, NaN in every
    unwritten slot and B's stale latents under D. Every token's output == uncached on the whole
    sequence."""
    w = _weights()
    lens = {"A": 11, "B": 7, "C": 6, "D": 8}
    tokens = {s: _tokens(1, n, seed=10 + i) for i, (s, n) in enumerate(lens.items())}
    ref = {s: wb.torch_mla(*tokens[s], w, scale=0.3)[0] for s in lens}
    run = PagedRun(w)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(5)).tolist()
    run.pages = {"A": perm[0:3], "B": perm[3:5], "C": perm[5:7]}
    got = {s: [] for s in lens}

    def record(res):
        for s, rows in res.items():
            got[s].append(rows)

    record(run.step([("A", 0, 3), ("B", 0, 5)], tokens))                 # two fresh prefills
    record(run.step([("A", 3, 5), ("C", 0, 4), ("B", 5, 1)], tokens))    # chunked prefill, prefill, decode
    record(run.step([("C", 4, 1), ("B", 6, 1), ("A", 8, 1)], tokens))    # decode only, different lengths
    run.pages["D"] = run.pages.pop("B")                                   # B done: D reuses its pages
    record(run.step([("D", 0, 2), ("A", 9, 1), ("C", 5, 1)], tokens))    # fresh prefill + decodes
    record(run.step([("D", 2, 5), ("A", 10, 1)], tokens))                 # chunked prefill over stale latents
    record(run.step([("D", 7, 1)], tokens))                               # one decode row
    for s in lens:
        out = torch.cat(got[s])
        assert out.shape == (lens[s], N, DV) and torch.isfinite(out).all()
        torch.testing.assert_close(out, ref[s], **TOL, msg=lambda m, s=s: f"sequence {s}: {m}")
    assert torch.isnan(run.cache).any()  # pages nobody wrote still hold NaN: nothing read them


def test_cached_writes_latent_and_rope_key_rows():
    """The cache rows are exactly [compressed_kv, kpe] at page_table[pos // page_size], pos % page_size."""
    w = _weights()
    tokens = _tokens(1, 6)
    cache = torch.zeros(5, 4, R + DR)
    i32 = dict(dtype=torch.int32)
    wb.torch_cached_mla(*tokens, w, cache, torch.tensor([6], **i32), torch.tensor([0], **i32),
                        torch.tensor([[3, 1]], **i32), 1, 0.3)
    rows = torch.cat([tokens[2][0], tokens[3][0, :, 0]], -1)
    torch.testing.assert_close(cache[3], rows[:4], rtol=0, atol=0)
    torch.testing.assert_close(cache[1, :2], rows[4:], rtol=0, atol=0)
    assert cache[[0, 2, 4]].abs().sum() == 0 and cache[1, 2:].abs().sum() == 0


def test_fresh_prefill_is_bit_identical_to_uncached():
    """What the numerics probe relies on to read 0.0 through the cached graph."""
    w = _weights()
    tokens = _tokens(1, 9)
    i32 = dict(dtype=torch.int32)
    out = wb.torch_cached_mla(*tokens, w, torch.zeros(4, 4, R + DR), torch.tensor([9], **i32),
                              torch.tensor([0], **i32), torch.tensor([[0, 1, 2]], **i32), 1, 0.3)
    assert torch.equal(out, wb.torch_mla(*tokens, w, scale=0.3))


def test_cached_rejects_inconsistent_metadata():
    w = _weights()
    tokens = _tokens(1, 3)
    cache = torch.zeros(4, 4, R + DR)
    lens, pos = torch.tensor([2, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_prefill=0"):
        wb.torch_cached_mla(*tokens, w, cache, lens, pos, table, 0, 0.3)
    with pytest.raises(ValueError, match="latent \\+ rope key"):
        wb.torch_cached_mla(*tokens, w, torch.zeros(4, 4, R), lens, pos, table, 1, 0.3)
    with pytest.raises(ValueError, match="page_table has 2 columns"):
        wb.torch_cached_mla(*tokens, w, cache, lens, torch.tensor([7, 0], dtype=torch.int32), table, 1, 0.3)
