"""Pattern matching that never changes the answer: masks classified by their values (in-place writes
included, any hidden fill), layout rewrites that keep ``view``s runnable, the spellings of
attention, repeat_kv, transposes, dropout and MoE that real model code uses, and the stepper's guard
that fails a re-spelling transform which moves the logits.

Each case exports a small module, runs the transform as the pipeline does (``match_support``) and
checks the op counts and the numbers against the eager module at two shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from match_support import check, count, export, gone, run
from test_match_moe import Llama4StyleMoe

from workbench.pipeline.matcher.masks import MaskKind, classify_mask

wb = torch.ops.workbench
QKV_DYN = {i: {0: "batch", 2: "seq"} for i in range(3)}
BSND_DYN = {i: {0: "batch", 1: "seq"} for i in range(3)}


def qkv(b=2, n=4, n_kv=4, s=6, d=8, dtype=torch.float32, seed=0, bsnd=False):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (b, s, h, d)) if bsnd else (lambda h: (b, h, s, d))
    return tuple(torch.randn(*shape(h), generator=g).to(dtype) for h in (n, n_kv, n_kv))


def attention_node(gm):
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_attention.default]
    return node


# ------------------------------------------------------------------------------ masks by meaning


def inplace_bool_mask(q, k, v):
    s = q.shape[2]
    m = torch.zeros(s, s, dtype=torch.bool)
    m[:, 1::2] = True  # every other key visible: not causal, not "all visible"
    m[:, 0] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def inplace_float_mask(q, k, v):
    s = q.shape[2]
    m = torch.zeros(s, s, dtype=q.dtype)
    m[..., 1::2] = float("-inf")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def inplace_causal_mask(q, k, v):
    s = q.shape[2]
    m = torch.zeros(s, s, dtype=q.dtype)
    m.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def eager_with_inplace_mask(q, k, v):
    s = q.shape[2]
    m = torch.zeros(s, s, dtype=q.dtype)
    m[..., 1::2] = torch.finfo(q.dtype).min
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + m
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("fn", [inplace_bool_mask, inplace_float_mask])
def test_mask_written_in_place_is_kept_and_read_after_the_write(fn):
    # Before: the bool mask was read before its fill_ (replacement placed after the zeros), the
    # float one classified "all visible" from its zeros and dropped: 0.39-1.9 off.
    gm = check("match_sdpa_to_torch_attention", fn, qkv(), matches=1, dynamic=QKV_DYN, other_args=qkv(b=3, s=9),
               atol=1e-5)
    node = attention_node(gm)
    assert node.kwargs["attn_mask"] is not None and not node.kwargs["is_causal"]


def test_causal_mask_written_in_place_becomes_is_causal():
    gm = check("match_sdpa_to_torch_attention", inplace_causal_mask, qkv(), matches=1, dynamic=QKV_DYN,
               other_args=qkv(b=1, s=11), atol=1e-5)
    node = attention_node(gm)
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None


def test_eager_attention_with_mask_written_in_place():
    gm = check("match_eager_attention", eager_with_inplace_mask, qkv(), matches=1, dynamic=QKV_DYN,
               other_args=qkv(b=3, s=9), atol=1e-5)
    assert count(gm, "workbench.torch_attention_sdpa.default") == 1
    out, _ = run("match_sdpa_to_torch_attention", gm)
    assert attention_node(out).kwargs["attn_mask"] is not None
    torch.testing.assert_close(out(*qkv(b=3, s=9)), eager_with_inplace_mask(*qkv(b=3, s=9)), atol=1e-5, rtol=1e-5)


def test_mask_written_after_it_is_read_is_not_classified():
    def two_reads(q, k, v):
        s = q.shape[2]
        m = torch.zeros(s, s, dtype=q.dtype)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # all visible here ...
        m.masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return a + F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # ... causal here

    gm = check("match_sdpa_to_torch_attention", two_reads, qkv(), matches=2, dynamic=QKV_DYN,
               other_args=qkv(b=3, s=9), atol=1e-5)
    nodes = [n for n in gm.graph.nodes if n.target is wb.torch_attention.default]
    assert all(n.kwargs["attn_mask"] is not None for n in nodes)


def full_triu(fill, mask_dtype=None):
    def fn(q, k, v):
        s = q.shape[2]
        m = torch.full((s, s), fill).triu(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(mask_dtype or q.dtype))

    return fn


@pytest.mark.parametrize(
    "fill, dtype",
    [
        (-65504.0, torch.float32),  # fp16's min in an fp32 mask
        (torch.finfo(torch.bfloat16).min, torch.float32),  # Llama 3.1: bf16 min kept in an fp32 mask
        (-1e9, torch.float32),
        (-1e9, torch.bfloat16),
        (float("-inf"), torch.bfloat16),
    ],
)
def test_causal_masks_of_any_hidden_value_become_is_causal(fill, dtype):
    fn = full_triu(fill)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    gm = check("match_sdpa_to_torch_attention", fn, qkv(dtype=dtype), matches=1, dynamic=QKV_DYN,
               other_args=qkv(b=3, s=9, dtype=dtype), atol=atol)
    node = attention_node(gm)
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None


def test_soft_bias_is_not_a_hidden_value():
    gm = export(full_triu(-1e4), qkv(), QKV_DYN)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) is None
    gm = export(full_triu(-65504.0), qkv(), QKV_DYN)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert classify_mask(sdpa.args[3], sdpa.args[0].meta["val"].shape[2]) == MaskKind(is_causal=True)


def test_kept_mask_is_refused_by_the_cache_stage_with_the_node_name():
    from workbench.pipeline.transforms.caches.attention import rewrite_attention

    gm = check("match_sdpa_to_torch_attention", inplace_float_mask, qkv(), matches=1, dynamic=QKV_DYN, atol=1e-5)
    node = attention_node(gm)
    with pytest.raises(ValueError, match=f"cannot cache attention node {node.name} .*explicit attn_mask"):
        rewrite_attention(gm, node, 0, wb.torch_attention.default, {}, torch.device("cpu"))


# ------------------------------------------------------------------------------ layouts before a view


def sdpa_then_view(x):
    b, s, _ = x.shape
    q = x.view(b, s, 4, 8).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, q * 0.5, q + 1, is_causal=True)  # CPU: [b, n, s, d] laid out bsnd
    return o.transpose(1, 2).contiguous().view(b, s, -1)  # export drops the no-op contiguous


def bsnd_attention_then_view(q, k, v):
    b, s, _, _ = q.shape
    o = wb.torch_attention(q, k, v, is_causal=True, layout="bsnd")
    return o.contiguous().view(b, s, -1)


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
def test_attention_layouts_keep_a_following_view_runnable(layout):
    x, x2 = torch.randn(2, 6, 32), torch.randn(3, 9, 32)
    dyn = {0: {0: "batch", 1: "seq"}}
    gm = check("match_sdpa_to_torch_attention", sdpa_then_view, (x,), matches=1, dynamic=dyn, other_args=(x2,),
               atol=1e-5)
    out, _ = run("match_attention_layout", gm, attn_layout=layout)
    out, _ = run("eliminate_redundant_transposes", out)
    for a in (x, x2):
        torch.testing.assert_close(out(a), sdpa_then_view(a), atol=1e-5, rtol=1e-5)
    assert count(out, "aten.view.default") + count(out, "aten.reshape.default") >= 1
    gm = check("match_attention_layout", bsnd_attention_then_view, qkv(bsnd=True), matches=int(layout == "bnsd"),
               dynamic=BSND_DYN, other_args=qkv(b=3, s=9, bsnd=True), attn_layout=layout, atol=1e-5)


# ------------------------------------------------------------------------------ spellings


def upcast_eager(q, k, v):
    s = q.shape[2]
    mask = torch.full((s, s), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    w = F.softmax(w.to(torch.float32), dim=-1).to(q.dtype)
    return torch.matmul(w, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eager_attention_with_upcast_softmax(dtype):
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    gm = check("match_eager_attention", upcast_eager, qkv(dtype=dtype), matches=1, dynamic=QKV_DYN,
               other_args=qkv(b=3, s=9, dtype=dtype), atol=atol)
    assert count(gm, "workbench.torch_attention_sdpa.default") == 1 and gone(gm, "aten.softmax.int")
    out, _ = run("match_sdpa_to_torch_attention", gm)
    assert attention_node(out).kwargs["is_causal"] is True


def test_upcast_to_another_dtype_is_not_attention():
    def bf16_softmax(q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3
        return torch.matmul(F.softmax(w.to(torch.bfloat16), dim=-1).to(q.dtype), v)

    check("match_eager_attention", bf16_softmax, qkv(), matches=0, dynamic=QKV_DYN)


def test_eval_mode_dropout_with_p_is_dropped_with_the_attention():
    def with_dropout(q, k, v):
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(F.dropout(w, p=0.1, training=False), v)

    gm = check("match_eager_attention", with_dropout, qkv(), matches=1, dynamic=QKV_DYN, other_args=qkv(b=3, s=9),
               atol=1e-5)
    assert gone(gm, "aten.dropout.default")


def repeat_bsnd(x, n_rep):
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


def bsnd_gqa(q, k, v):
    k, v = repeat_bsnd(k, 4), repeat_bsnd(v, 4)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


def test_repeat_kv_in_bsnd_reaches_attention_unrepeated():
    args, other = qkv(n=8, n_kv=2, bsnd=True), qkv(b=3, n=8, n_kv=2, s=9, bsnd=True)
    gm = check("match_repeat_kv", bsnd_gqa, args, matches=2, dynamic=BSND_DYN, other_args=other)
    gm, _ = run("match_sdpa_to_torch_attention", gm)
    gm, info = run("match_grouped_attention", gm)
    assert info.num_matches == 1
    node = attention_node(gm)
    assert node.args[1].meta["val"].shape[1] == 2  # 2 KV heads, not 8 repeated ones
    assert gone(gm, "workbench.torch_attention_repeat_kv.default")
    for a in (args, other):
        torch.testing.assert_close(gm(*a), bsnd_gqa(*a), atol=1e-5, rtol=1e-5)


def test_transpose_contiguous_transpose_cancels():
    def chain(x):
        b, s, h = x.shape
        y = x.view(b, s, 4, 8).transpose(1, 2).contiguous()
        return y.transpose(1, 2).contiguous().view(b, s, h) * 2

    gm = check("eliminate_redundant_transposes", chain, (torch.randn(2, 6, 32),), matches=1,
               dynamic={0: {0: "batch", 1: "seq"}}, other_args=(torch.randn(3, 9, 32),))
    assert gone(gm, "aten.transpose.int")


# ------------------------------------------------------------------------------ MoE spellings

H, INTER, E, K = 16, 8, 4, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(H, INTER, bias=False), nn.Linear(INTER, H, bias=False), nn.Linear(H, INTER, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralLoopMoe(nn.Module):
    """Mixtral's classic sparse MoE block (transformers < 5): a loop over nn.Linear experts."""

    def __init__(self, n_experts=E, skip=None):
        super().__init__()
        torch.manual_seed(0)
        self.n, self.skip = n_experts, skip
        self.gate = nn.Linear(H, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))

    def forward(self, hidden):
        b, s, h = hidden.shape
        x = hidden.view(-1, h)
        w = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        w, sel = torch.topk(w, K, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros((b * s, h), dtype=x.dtype, device=x.device)
        mask = F.one_hot(sel, num_classes=self.n).permute(2, 1, 0)
        for e in range(self.n):
            if e == self.skip:
                continue
            idx, top_x = torch.where(mask[e])
            cur = x[None, top_x].reshape(-1, h)
            cur = self.experts[e](cur) * w[top_x, idx, None]
            out.index_add_(0, top_x, cur.to(x.dtype))
        return out.reshape(b, s, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_expert_loop_becomes_torch_moe(dtype):
    m = MixtralLoopMoe().to(dtype).eval()
    x, x2 = torch.randn(2, 3, H, dtype=dtype), torch.randn(3, 5, H, dtype=dtype)
    gm = check("match_moe_pattern", m, (x,), matches=1, dynamic={0: {0: "batch", 1: "seq"}}, other_args=(x2,),
               atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert count(gm, "workbench.torch_moe.default") == 1
    for op in ("aten.index_add_.default", "aten.where.default", "aten.one_hot.default"):
        assert gone(gm, op), op
    with torch.no_grad():
        torch.testing.assert_close(gm(x2), m(x2), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)


def test_moe_expert_loop_near_miss_an_expert_left_out():
    check("match_moe_pattern", MixtralLoopMoe(skip=2).eval(), (torch.randn(2, 3, H),), matches=0,
          dynamic={0: {0: "batch", 1: "seq"}})


@pytest.mark.parametrize("key, on_input", [("match_bmm_moe_pattern", True), ("match_dense_moe_pattern", False)])
def test_bmm_moe_with_up_rows_first(key, on_input):
    torch.manual_seed(0)
    gm = check(key, Llama4StyleMoe(on_input, up_first=True), (torch.randn(2, 3, H),), matches=1, dynamic={0: {0: "batch", 1: "seq"}},
               other_args=(torch.randn(3, 2, H),), atol=1e-5)
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_moe_dense_mlp.default]
    assert node.kwargs["up_first"] is True and gone(gm, "aten.bmm.default")


# ------------------------------------------------------------------------------ the stepper's guard


def test_a_matcher_that_changes_the_answer_fails_its_step(tiny_llama):
    """A deliberately wrong rewrite (causal attention made bidirectional) in the pattern_matcher
    stage: the step fails with the transform, the first node it rewrote and the numbers; with
    skip_on_error it is undone and recorded failed; the run goes on without it."""
    from workbench import Workbench
    from workbench.pipeline.interface import TRANSFORMS, Transform, TransformError, TransformInfo
    from workbench.pipeline.matcher import annotate_new_nodes

    class DropCausal(Transform):
        def _apply(self, gm, ctx):
            n = 0
            for node in list(gm.graph.nodes):
                if node.target is wb.torch_attention.default and node.kwargs.get("is_causal"):
                    with gm.graph.inserting_before(node):
                        new = gm.graph.call_function(node.target, node.args, {**node.kwargs, "is_causal": False})
                    node.replace_all_uses_with(new)
                    gm.graph.erase_node(node)
                    annotate_new_nodes(gm, [new], [node.name], anchor=new)
                    n += 1
            gm.recompile()
            return gm, TransformInfo(num_matches=n)

    reg = TRANSFORMS.copy()
    reg.register("drop_causal_on_purpose")(DropCausal)
    extra = {"transforms": {"drop_causal_on_purpose": {"stage": "pattern_matcher"}}}
    bench = Workbench(tiny_llama, yaml_extra=[extra], registry=reg)
    with pytest.raises(TransformError) as e:
        bench.run_to("drop_causal_on_purpose")
    msg = str(e.value)
    assert "drop_causal_on_purpose changed the model's answer" in msg and "rmse ratio" in msg
    assert "the first node it rewrote: torch_attention" in msg and "replacing " in msg
    assert bench.status("drop_causal_on_purpose") == "failed"
    assert all(s.status in ("done", "skipped") for s in bench.snapshots)  # nothing before it lost

    bench.configure("drop_causal_on_purpose", skip_on_error=True)
    snap = bench.run_to("drop_causal_on_purpose")[-1]
    assert snap.status == "failed" and "changed the model's answer" in snap.info.skip_reason
    assert snap.numerics.rmse_ratio < 1e-4  # undone before its probe
