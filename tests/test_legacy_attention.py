"""Older eager attention spellings (``pipeline/transforms/attention/legacy.py``): logits replaced
through a causal table the module registers, as GPT-Neo (``torch.where``) and OpenAI GPT
(``w * b - 1e4 * (1 - b)``) write it. Per spelling: the match keeps the numbers, the table's mask
is classified once its values are known, fills that are not hidden values and tables that are not
0/1 are never taken for causality; XGLM's BART-style attention over heads folded into the batch
(``attention/bmm_heads.py``); then the older families end to end (``tiny_families/legacy_attention.py``:
GPT-Neo, OpenAI GPT, CTRL, BioGPT, XGLM): every layer cached (GPT-Neo's local layer with its window) and
greedy tokens equal to HF's; and a spelling left unmatched says "uncached" where a user reads it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from match_support import check, export, run
from test_match_meaning import QKV_DYN, attention_node, qkv
from test_more_families import cached_greedy_equals_hf

from workbench import Workbench
from workbench.models.tiny_families import legacy_attention
from workbench.onboarding.check import UNCACHED_RUNNER, uncached_attention_left
from workbench.onboarding.registry import load_registry
from workbench.pipeline.matcher.masks import MaskKind, classify_mask
from workbench.pipeline.transforms.caches.attention import uncached_attention

ONE_THREAD = True  # see conftest.one_thread
TABLE = 64  # the registered table's size: the longest sequence the exported graph allows (QKV_DYN)


class WhereTable(nn.Module):
    """GPT-Neo's ``_attn``: unscaled logits, ``where(table, w, fill)``, softmax, cast, matmul."""

    def __init__(self, window=None, fill=None):
        super().__init__()
        table = torch.ones(TABLE, TABLE, dtype=torch.bool).tril()
        if window is not None:
            table = table ^ torch.tril(table, -window)  # GPT-Neo's local layers
        self.register_buffer("bias", table.view(1, 1, TABLE, TABLE), persistent=False)
        self.fill = fill

    def forward(self, q, k, v):
        w = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
        s_q = s_k = q.size(-2)  # self-attention (the export gives k its own length symbol)
        table = self.bias[:, :, s_k - s_q : s_k, :s_k]
        fill = torch.tensor(self.fill if self.fill is not None else torch.finfo(w.dtype).min, dtype=w.dtype)
        w = torch.where(table, w, fill)
        p = F.softmax(w, dim=-1).to(v.dtype)
        return torch.matmul(p, v)


class ArithTable(nn.Module):
    """OpenAI GPT's ``_attn``: the key permuted to [b, h, d, s], logits / sqrt(d), then
    ``w * b + -1e4 * (1 - b)`` with a float table."""

    def __init__(self, table=None):
        super().__init__()
        t = torch.ones(TABLE, TABLE).tril() if table is None else table
        self.register_buffer("bias", t.view(1, 1, TABLE, TABLE), persistent=False)

    def forward(self, q, k, v):
        kt = k.permute(0, 1, 3, 2)
        w = torch.matmul(q, kt) / math.sqrt(v.size(-1))
        s = q.size(-2)
        b = self.bias[:, :, :s, :s]
        w = w * b + -1e4 * (1 - b)
        return torch.matmul(F.softmax(w, dim=-1), v)


class BmmHeads(nn.Module):
    """XGLM's attention core on [b, n, s, d] q (pre-scaled), k, v: heads folded into the batch for
    two ``bmm``s, HF's additive causal mask added and the logits clamped at ``clamp``."""

    def __init__(self, clamp=None):
        super().__init__()
        self.clamp = clamp

    def forward(self, q, k, v):
        b, n, s, d = q.shape
        w = torch.bmm(q.reshape(b * n, -1, d), k.reshape(b * n, -1, d).transpose(1, 2))
        keep = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)[None, None]
        clamp = torch.finfo(w.dtype).min if self.clamp is None else self.clamp
        w = torch.max(w.view(b, n, s, s) + mask, torch.full((), clamp, device=w.device)).view(b * n, s, s)
        p = F.softmax(w, dim=-1).view(b, n, s, s).view(b * n, s, s)
        p = F.dropout(p, p=0.1, training=False)
        return torch.bmm(p, v.reshape(b * n, -1, d)).view(b, n, s, d)


def test_bmm_heads_attention_becomes_causal_attention_with_the_same_numbers():
    gm = check("match_eager_attention", BmmHeads(), qkv(n_kv=4), matches=1, dynamic=QKV_DYN,
               other_args=qkv(n_kv=4, b=3, s=9), atol=1e-5)  # fmt: skip
    node = attention_node(gm)
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None and node.kwargs["scale"] == 1.0
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.max.other)]
    # a clamp at -1000 can lift a hidden logit into the softmax: not matched, reported uncached
    gm = check("match_eager_attention", BmmHeads(clamp=-1000.0), qkv(n_kv=4), matches=0, dynamic=QKV_DYN)
    assert len(uncached_attention(gm)) == 1


def _mask_kind(gm):
    node = attention_node(gm)
    mask = node.kwargs["attn_mask"]
    assert mask is not None  # the table's values are only trusted after load: classified later
    return classify_mask(mask, node.args[0].meta["val"].shape[2])


@pytest.mark.parametrize(
    "module, kind",
    [
        (WhereTable(), MaskKind(is_causal=True)),
        (WhereTable(window=3), MaskKind(is_causal=True, sliding_window=3)),
        (ArithTable(), MaskKind(is_causal=True)),
    ],
    ids=["where", "where_banded", "arith"],
)
def test_table_spellings_become_attention_with_the_same_numbers(module, kind):
    gm = check("match_eager_attention", module, qkv(), matches=1, dynamic=QKV_DYN,
               other_args=qkv(b=3, s=9), atol=1e-5)  # fmt: skip
    assert _mask_kind(gm) == kind


def test_a_where_fill_that_is_not_a_hidden_value_is_not_attention_and_says_uncached():
    # where(table, w, -1000): the replaced logit keeps weight exp(-1000 - max) only when the visible
    # logits are near -1000 too; not provably a hidden key, so not matched (and reported uncached)
    module = WhereTable(fill=-1000.0)
    gm = check("match_eager_attention", module, qkv(), matches=0, dynamic=QKV_DYN)
    left = uncached_attention(gm)
    assert len(left) == 1 and "eager softmax over q @ k^T" in next(iter(left.values()))


def test_a_table_that_is_not_zero_one_is_never_taken_for_causality():
    # b * w with b = 0.5 scales logits: the replacement's mask turns NaN there (the numerics check
    # fails loudly) and the classifier sees no causal mask
    table = torch.ones(TABLE, TABLE).tril()
    table[3, 1] = 0.5
    module = ArithTable(table)
    args = qkv()
    gm = export(module, args, QKV_DYN)
    out, info = run("match_eager_attention", gm)
    assert info.num_matches == 1
    assert _mask_kind(out) is None
    assert torch.isnan(out(*args)).any() and not torch.isnan(module(*args)).any()


# ------------------------------------------------------------------------------ the families


ARCHS = sorted(legacy_attention.ARCHS)
TABLE_FORMS = {"gpt_neo": "where", "openai_gpt": "arith"}  # ctrl, biogpt: SDPA, their masks made in forward


def test_legacy_families_are_in_the_registry():
    listed = {e.name for e in load_registry().entries}
    assert {f"tiny:{a}" for a in ARCHS} <= listed


@pytest.mark.parametrize("arch", ARCHS)
def test_legacy_family_cached_greedy_equals_hf(arch):
    bench = cached_greedy_equals_hf(arch)
    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches == 2
    windows = [n.kwargs.get("sliding_window") for n in bench.module.graph.nodes if "cached_attention" in str(n.target)]
    if arch == "xglm":  # BART-style attention: matched by the bmm-heads spelling
        matched = bench.snapshot("match_eager_attention").info.details["matches"]
        assert sum(n for name, n in matched.items() if name.startswith("bmm_heads_attention")) == 2, matched
    assert windows == ([4, None] if arch == "gpt_neo" else [None, None])  # GPT-Neo: local, then global
    form = TABLE_FORMS.get(arch)
    if form is not None:  # the table spellings: matched here, their masks classified after load
        matched = bench.snapshot("match_eager_attention").info.details["matches"]
        assert sum(n for name, n in matched.items() if name.startswith(f"legacy_{form}_")) == 2, matched
        assert info.details["masks_classified_after_load"] == 2


def test_gpt_neo_left_unmatched_runs_uncached_and_says_so():
    bench = Workbench("tiny:gpt_neo", numerics=False, overrides={"match_eager_attention.enabled": False})
    bench.run()
    info = bench.snapshot("insert_cached_attention").info
    assert "2 attention node(s) left without a KV cache" in info.skip_reason and "uncached" in info.skip_reason
    for layer in (0, 1):  # the HF modules named, with the spelling seen
        assert f"eager softmax over q @ k^T (matmul + softmax attention the pattern matcher did not " \
               f"canonicalize) [in transformer.h.{layer}.attn.attention]" in info.skip_reason  # fmt: skip
    assert len(uncached_attention_left(bench.snapshots)) == 2
    out = bench.generate([[5, 6, 7]], max_new_tokens=2, stop_token_ids=[])
    assert out.stats.cache.startswith(UNCACHED_RUNNER)
    assert "attention UNCACHED: 2 layer(s) without a KV cache" in bench.backends_line()
