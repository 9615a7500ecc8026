"""ALiBi attention (BLOOM, MPT, Falcon-RW), end to end: the canonical op with ``alibi_slopes`` equals
the HF attention module it replaces, the pattern stage reads the slopes off every spelling HF uses
(eager BLOOM/MPT/Falcon, Falcon's SDPA mask) and leaves near misses alone, the cached ops (torch,
the C++ CPU kernel, Triton under the interpreter) equal the uncached op over prefill, chunked
prefill and decode rows, and cached generation equals HF greedy generation with every layer cached.

Expected slopes (logit units: what the canonical op adds per unit of ``k_pos - q_pos``) come from
HF's own slope functions: BLOOM ``_get_alibi_slopes``; MPT ``build_mpt_alibi_tensor`` (another
formula); Falcon its ``build_alibi_tensor`` slopes (rounded to bf16) divided by ``sqrt(head_dim)``
-- with SDPA the bias reaches the logits once, through the mask; with eager attention twice.

Weights for the op tests: the tiny archs' init (0.015-0.03) makes every attention logit ~0, so they
use std 0.2 (peaked attention) and assert that dropping the slopes moves the result far outside the
tolerance (atol = rtol = 2e-5: the same fp32 math in another order).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from match_support import check as check_match
from test_runtime import _hf_greedy
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS
from workbench.pipeline.matcher import named_args
from workbench.pipeline.transforms.attention.alibi_slopes import slopes_constant
from workbench.pipeline.weights import tensor_bindings

wb = torch.ops.workbench
TOL = dict(atol=2e-5, rtol=2e-5)
B, S = 2, 11
HEADS, HEAD_DIM = 4, 16
FAMILIES = ("bloom", "mpt", "falcon_alibi", "falcon_alibi_eager")


def load_family(arch: str, dtype: str = "float32", **changes):
    """``tiny:<arch>`` with ``changes`` to its config, from a private registry."""
    base = TINY_ARCHS[arch]

    def build():
        config = base()
        for key, value in changes.items():
            setattr(config, key, value)
        return config

    return load_model(f"tiny:{arch}", tiny_registry={**TINY_ARCHS, arch: build}, dtype=dtype)


def expected_slopes(arch: str, n: int = HEADS, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """The canonical slopes of ``arch`` from HF's own slope code (see the module docstring)."""
    if arch == "bloom":
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

        return _get_alibi_slopes(n, torch.device("cpu"))
    if arch == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        table = build_mpt_alibi_tensor(n, 2)  # [n, 1, 2]: slope * (k_pos - 1)
        return table[:, 0, 1] - table[:, 0, 0]
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    slopes = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), n, torch.float32)[:, 0, 1]  # bf16-rounded
    return slopes / math.sqrt(head_dim) * (2 if arch == "falcon_alibi_eager" else 1)


def causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).tril()


# ------------------------------------------------------------------------------ op == HF module


def _hf_and_canonical(arch: str, model, hidden: torch.Tensor):
    """(HF attention module's output, ``fn(slopes)``: the same from the canonical op) for layer 0,
    with the bias and mask HF's model forward builds for a fresh prefill of ``hidden``."""
    b, s, _ = hidden.shape
    min_f32 = torch.finfo(torch.float32).min
    if arch == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        attn = model.transformer.h[0].self_attention
        alibi = build_alibi_tensor(torch.ones(b, s, dtype=torch.long), HEADS, torch.float32)  # [b*n, 1, s]
        mask = torch.zeros(1, 1, s, s).masked_fill(~causal(s), min_f32)
        residual = torch.zeros_like(hidden)
        ref, _ = attn(hidden, residual, alibi, mask)
        qkv = attn.query_key_value(hidden).view(b, s, HEADS, 3, HEAD_DIM)
        q, k, v, scale, out_proj = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], attn.inv_norm_factor, attn.dense
    elif arch == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        attn = model.transformer.blocks[0].attn
        bias = build_mpt_alibi_tensor(HEADS, model.config.max_seq_len)  # [n, 1, max_seq_len]
        ref, _ = attn(hidden, position_bias=bias, attention_mask=~causal(s)[None, None])
        q, k, v = (t.reshape(b, s, HEADS, HEAD_DIM) for t in attn.Wqkv(hidden).chunk(3, dim=2))
        scale, out_proj = attn.softmax_scale, attn.out_proj
    else:
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        attn = model.transformer.h[0].self_attention
        alibi = build_alibi_tensor(torch.ones(b, s, dtype=torch.long), HEADS, torch.float32)  # [b*n, 1, s]
        mask = (alibi.view(b, HEADS, 1, s) / math.sqrt(HEAD_DIM)).masked_fill(~causal(s), min_f32)  # HF's folding
        ref, _ = attn(hidden, alibi=alibi, attention_mask=mask)
        qkv = attn.query_key_value(hidden).view(b, s, HEADS, 3, HEAD_DIM)
        q, k, v, scale, out_proj = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], 1 / math.sqrt(HEAD_DIM), attn.dense

    def canonical(slopes):
        out = wb.torch_attention(q, k, v, is_causal=True, scale=scale, layout="bsnd", alibi_slopes=slopes)
        out = out_proj(out.reshape(b, s, -1))
        return out + residual if arch == "bloom" else out

    return ref, canonical


@pytest.mark.parametrize("arch", FAMILIES)
def test_canonical_op_equals_hf_attention_module(arch):
    model = load_family(arch, initializer_range=0.2).model
    hidden = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, canonical = _hf_and_canonical(arch, model, hidden)
        torch.testing.assert_close(canonical(expected_slopes(arch)), ref, **TOL)
        # The slopes matter here: without them (or with another family's) the result is far off.
        assert (canonical(None) - ref).abs().max() > 100 * TOL["atol"]
        assert (canonical(expected_slopes(arch) * 0.5) - ref).abs().max() > 100 * TOL["atol"]


def test_canonical_op_bias_is_relative_and_bottom_right_aligned():
    """``slope * (k_pos - q_pos)``, queries the last ``s_q`` of ``s_k`` positions: the rows of a
    decode-shaped call equal the last rows of the full call."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, 9, HEAD_DIM, generator=g) for _ in range(3))
    slopes = expected_slopes("bloom")
    full = wb.torch_attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    last = wb.torch_attention(q[:, :, -3:], k, v, is_causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(last, full[:, :, -3:], **TOL)
    # an explicit reference: softmax(q k^T / sqrt(d) + slope (j - i)) causal
    rel = (torch.arange(9)[None, :] - torch.arange(9)[:, None]).float()
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM) + slopes[:, None, None] * rel
    ref = logits.masked_fill(~causal(9), float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(full, ref, **TOL)


# ------------------------------------------------------------------------------ the matchers


def _mpt_like(qkv, power: int = 1, window=None):
    """MPT's spelling on q, k, v = ``qkv`` [3, b, n, s, d] (one input, as one projection: their
    lengths are one size): a [n, 1, 64] bias table sliced to the keys, a boolean causal mask (True =
    hidden; optionally also hiding keys ``window`` or more back); ``power`` 2 makes the bias
    quadratic in the key position (not ALiBi)."""
    q, k, v = qkv[0], qkv[1], qkv[2]
    n, s = q.shape[1], q.shape[2]
    table = torch.arange(1 - 64, 1, dtype=torch.int32).view(1, 1, 64)
    slopes = (1.0 / torch.pow(2, torch.arange(1, n + 1).float() * (8 / n))).view(n, 1, 1)
    bias = (-(table.float() ** 2) if power == 2 else table) * slopes
    bias = bias[:, max(0, 1 - s) :, max(0, 64 - s) :]
    pos = torch.arange(s)
    hidden = pos[None, :] > pos[:, None]
    if window is not None:
        hidden = hidden | (pos[:, None] - pos[None, :] >= window)
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + bias
    w = w.masked_fill(hidden[None, None], torch.finfo(torch.float32).min)
    p = F.softmax(w.float(), dim=-1).to(v.dtype)
    p = F.dropout(p, p=0.0, training=False)
    return torch.matmul(p, v)


def _qkv(s: int, seed: int = 0):
    return (torch.randn(3, 1, HEADS, s, HEAD_DIM, generator=torch.Generator().manual_seed(seed)),)


DYNAMIC = {0: {3: "s"}}


def test_matcher_reads_slopes_and_generalises_over_lengths():
    gm = check_match("match_eager_attention", _mpt_like, _qkv(7), matches=1, dynamic=DYNAMIC, other_args=_qkv(13, 1))
    (node,) = [n for n in gm.graph.nodes if n.target is wb.torch_attention.default]
    args = dict(named_args(node))
    assert args["is_causal"] and args["attn_mask"] is None and args["scale"] == 0.25
    slopes = getattr(gm, args["alibi_slopes"].target)
    torch.testing.assert_close(slopes, expected_slopes("mpt"), atol=0, rtol=0)


@pytest.mark.parametrize("near_miss", [dict(power=2), dict(window=3)], ids=["quadratic_bias", "windowed_mask"])
def test_near_misses_are_left_alone(near_miss):
    """A bias that is not linear in the key position, or a mask that hides more than the future:
    not ALiBi, so the chain stays as it is (and so does the graph)."""
    check_match("match_eager_attention", lambda qkv: _mpt_like(qkv, **near_miss), _qkv(7), matches=0, dynamic=DYNAMIC)


SIX_HEADS = {  # 6 heads of 16: BLOOM's and MPT's formulas take their non-power-of-two branches
    "bloom": dict(n_head=6, hidden_size=96),
    "mpt": dict(n_heads=6, d_model=96),
    "falcon_alibi": dict(num_attention_heads=6, num_kv_heads=6, hidden_size=96),
}


@pytest.mark.parametrize(
    "arch,dtype,heads",
    [(a, "bfloat16", 4) for a in FAMILIES] + [(a, "float32", 6) for a in SIX_HEADS],
)
def test_slopes_are_read_in_half_precision_and_at_other_head_counts(arch, dtype, heads):
    """bf16 models spell the same attention with other casts (Falcon's eager logits cast to fp32,
    MPT's probabilities to bf16); 6 heads give slopes that are no powers of two."""
    changes = SIX_HEADS[arch] if heads == 6 else {}
    bench = Workbench(load_family(arch, dtype=dtype, **changes), numerics=False)
    bench.run_to("match_attention_layout")
    nodes = [n for n in bench.module.graph.nodes if n.target is wb.torch_attention.default]
    assert len(nodes) == 2 and {n.kwargs["alibi_slopes"].target for n in nodes} == {"alibi_slopes"}
    assert bench.module.alibi_slopes.is_meta  # the unloaded graph holds no weights ...
    made = tensor_bindings(bench.module)["alibi_slopes"]  # ... the slopes are made at load
    torch.testing.assert_close(made.convert(**dict(made.kwargs)), expected_slopes(arch, heads), atol=0, rtol=0)


# ------------------------------------------------------------------------------ cached ops


def _cached_vs_uncached(op, **kwargs):
    """Three sequences through ``op`` in two steps -- step 1 prefills each (7, 4, 13 tokens), step 2
    mixes a chunked prefill (sequence 0, 5 more tokens) with two decode rows -- on shuffled 4-slot
    pages; every output row must equal the uncached op's row at that position."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, ps = 4, 2, HEAD_DIM, 4
    slopes = expected_slopes("mpt")
    lens = (12, 5, 14)
    seqs = [tuple(torch.randn(1, n, h, d, generator=g) for h in (hq, hkv, hkv)) for n in lens]
    ref = [wb.torch_attention(q, k, v, is_causal=True, layout="bsnd", alibi_slopes=slopes) for q, k, v in seqs]
    k_cache, v_cache = torch.zeros(16, ps, hkv, d), torch.zeros(16, ps, hkv, d)
    page_table = torch.randperm(15, generator=g)[:12].view(3, 4).to(torch.int32)
    steps = [  # (sequence, first token, tokens) per row; prefill rows first
        [(0, 0, 7), (1, 0, 4), (2, 0, 13)],
        [(0, 7, 5), (1, 4, 1), (2, 13, 1)],
    ]
    for rows in steps:
        q, k, v = (torch.cat([seqs[i][x][:, a : a + n] for i, a, n in rows], dim=1) for x in range(3))
        num_prefill = sum(n > 1 or a == 0 for _, a, n in rows)
        out = op(q, k, v, k_cache, v_cache, torch.tensor([n for *_, n in rows], dtype=torch.int32),
                 torch.tensor([a for _, a, _ in rows], dtype=torch.int32), page_table[[i for i, *_ in rows]].contiguous(),
                 num_prefill, 1 / math.sqrt(d), alibi_slopes=slopes, **kwargs)
        t = 0
        for i, a, n in rows:
            torch.testing.assert_close(out[:, t : t + n], ref[i][:, a : a + n], **TOL)
            t += n


def test_torch_cached_attention_with_slopes_equals_uncached():
    _cached_vs_uncached(wb.torch_cached_attention)


def test_cpu_kernel_with_slopes_equals_uncached():
    """The C++ kernel serves decode-only steps (ALiBi there) and hands the rest to the reference:
    a decode-only step is added so the kernel itself runs."""
    from workbench.ops import cpu_kernels

    ok, why = cpu_kernels.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    _cached_vs_uncached(wb.cpu_cached_attention)
    # decode only, three sequences at positions 3, 9, 20, against the uncached op
    g = torch.Generator().manual_seed(6)
    slopes = expected_slopes("bloom")
    qs, ks, vs = (torch.randn(1, 21, h, HEAD_DIM, generator=g) for h in (4, 2, 2))
    k_cache, v_cache = torch.zeros(24, 4, 2, HEAD_DIM), torch.zeros(24, 4, 2, HEAD_DIM)
    page_table = torch.arange(18, dtype=torch.int32).view(3, 6)
    positions = (3, 9, 20)
    for i, p in enumerate(positions):  # fill each sequence's cache up to p with the reference op
        wb.torch_cached_attention(qs[:, :p], ks[:, :p], vs[:, :p], k_cache, v_cache, torch.tensor([p], dtype=torch.int32),
                                  torch.tensor([0], dtype=torch.int32), page_table[i : i + 1], 1, 0.25,
                                  alibi_slopes=slopes)
    q, k, v = (x[:, list(positions)] for x in (qs, ks, vs))
    out = wb.cpu_cached_attention(q, k, v, k_cache, v_cache, torch.ones(3, dtype=torch.int32),
                                  torch.tensor(positions, dtype=torch.int32), page_table, 0, 0.25, alibi_slopes=slopes)
    for i, p in enumerate(positions):
        ref = wb.torch_attention(qs[:, : p + 1], ks[:, : p + 1], vs[:, : p + 1], is_causal=True, scale=0.25,
                                 layout="bsnd", alibi_slopes=slopes)
        torch.testing.assert_close(out[:, i], ref[:, p], **TOL)


def test_flashinfer_refuses_alibi_by_name(monkeypatch):
    """FlashInfer derives its own ALiBi slopes: the backend choice refuses ALiBi layers (a shape it
    otherwise takes: head_dim 64, bf16) naming the backends that serve them, and the op refuses a
    call with slopes before it needs a GPU."""
    import importlib

    from workbench.ops.backends import ATTENTION_BACKENDS
    from workbench.pipeline.transforms.caches.attention import _attention_nodes, layer_shapes
    from workbench.pipeline.transforms.caches.attention_backend import resolve_backend, unsupported_layers

    bench = Workbench(load_family("falcon_alibi", dtype="bfloat16", hidden_size=256), numerics=False)
    bench.run_to("match_attention_layout")
    nodes = _attention_nodes(bench.module)
    assert len(nodes) == 2 and all(n.kwargs.get("alibi_slopes") is not None for n in nodes)
    fi = importlib.import_module("workbench.ops.attention.flashinfer_cached_attention")
    monkeypatch.setattr(fi, "is_available", lambda device=None: (True, "faked"))
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", torch.device("cpu"), layer_shapes(nodes))
    assert "ALiBi slopes (not supported by this backend) (layers [0, 1])" in str(err.value)
    for name in ("torch", "cpu", "triton"):  # the backends that do take ALiBi
        assert unsupported_layers(ATTENTION_BACKENDS.get(name), layer_shapes(nodes)) == {}
    q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="ALiBi slopes"):
        fi.flashinfer_cached_attention(q, k, k, cache, cache, one, one * 0, one[None] * 0, 1, 0.125,
                                       alibi_slopes=torch.ones(4))


# ------------------------------------------------------------------------------ cached generation

PROMPT_LENS = (3, 11, 19)  # 19 + 16 spans 3 pages
NEW = 16


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch,backend", [(a, "auto") for a in FAMILIES] + [("bloom", "torch"), ("falcon_alibi", "torch")])
def test_cached_generation_equals_hf(arch, backend):
    """Every attention layer canonical with the family's slopes (one shared graph constant), every
    one cached, nothing left to re-run uncached, and greedy tokens equal to HF's (3 prompts of
    different lengths in one batch, 16 new tokens). ``auto``: the C++ kernel for decode steps where
    it builds (prefill: the reference), else the torch reference."""
    loaded = load_family(arch)
    bench = Workbench(loaded, numerics=False, overrides={"insert_cached_attention.backend": backend})
    bench.run()

    graph = bench.snapshot("match_attention_layout").graph
    nodes = [n for n in graph.nodes if n.target is wb.torch_attention.default]
    assert len(nodes) == loaded.model.config.num_hidden_layers
    targets = set()
    for node in nodes:
        args = dict(named_args(node))
        assert args["is_causal"] and args["attn_mask"] is None and args["sliding_window"] is None, args
        assert args["alibi_slopes"].op == "get_attr"
        targets.add(args["alibi_slopes"].target)
    (target,) = targets  # every layer shares one constant, made at load by a declared conversion ...
    assert tensor_bindings(bench.module)[target].convert is slopes_constant
    torch.testing.assert_close(getattr(bench.module, target).cpu(), expected_slopes(arch), atol=0, rtol=0)

    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches == len(nodes) and info.skip_reason is None, info
    assert "uncached_attention" not in info.details
    cached = [n for n in bench.module.graph.nodes if str(n.target).endswith("cached_attention.default")]
    assert len(cached) == len(nodes) and all(n.kwargs.get("alibi_slopes") is not None for n in cached)

    prompts = _prompts(bench.ctx.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert out.stats.max_concurrency == len(prompts)
    for prompt, result in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, prompt, NEW)
        assert len(set(want)) >= 8, f"{arch}: HF's tokens repeat ({want}): the comparison would prove little"
        assert result.token_ids == want, (arch, backend, len(prompt))


# ------------------------------------------------------------------------------ Triton (interpreter child)


def _interpreter_checks() -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    tca = __import__("importlib").import_module("workbench.ops.attention.triton_cached_attention")
    return {
        "triton_op": lambda: _cached_vs_uncached(wb.triton_cached_attention),
        "triton_split_decode": lambda: _cached_vs_uncached(tca.cached_attention_forward, num_splits=3),
        "triton_generate_bloom": lambda: generate_with_triton_backend_equals_hf(
            "bloom", "insert_cached_attention", "triton_cached_attention", 2
        ),
    }


interpreter_results = interpreter_results_fixture(__file__, timeout=900)


@pytest.mark.parametrize("case", ["triton_op", "triton_split_decode", "triton_generate_bloom"])
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


if __name__ == "__main__":
    child_main(_interpreter_checks)
