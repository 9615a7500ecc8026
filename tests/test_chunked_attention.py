"""Chunked local attention (Llama 4's ``attention_chunk_size``) as a mask variant of the canonical
attention op, like the sliding window: a key at position k is visible to the query at position q
iff ``k <= q`` and ``k // chunk == q // chunk``.

* the mask HF builds (``masking_utils.create_chunked_causal_mask``) is classified as
  ``chunk_size`` (and a near miss is not), so the pattern stage drops it for the op's argument;
* ``torch_attention(..., chunk_size=c)`` == the HF attention module it replaces, with HF's mask;
* the cached ops (torch reference, the C++ CPU kernel, Triton under ``TRITON_INTERPRET=1``) ==
  ``torch_attention(chunk_size=c)`` over each sequence's whole keys, for prefill, chunked prefill,
  decode and mixed steps whose positions cross chunk boundaries; FlashInfer refuses it by name;
* ``tiny:llama4_text`` (a chunked RoPE layer, then a full NoPE MoE layer) generates HF's greedy
  tokens through the paged KV cache, every attention layer cached.

Weights: std 0.2 (``initializer_range``) in the op test, so attention is peaked and hiding the keys
of the previous chunk really moves the output (asserted). Tolerances as in
``test_attention_variants.py``: fp32 round-off between SDPA with a boolean mask and the explicit
softmax, ``atol = rtol = 2e-5``; the paged ops against the dense op ``1e-5``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS
from workbench.models.tiny_families.chunked import CHUNK
from workbench.pipeline.matcher import export_graph_module, named_args
from workbench.pipeline.matcher.masks import MaskKind, classify_mask

wb = torch.ops.workbench
TOL = dict(atol=2e-5, rtol=2e-5)
ARCH = "llama4_text"


def load_llama4(std: float = 0.02, dtype: str = "float32"):
    """``tiny:llama4_text`` with weights of std ``std`` (from a private registry)."""

    def build():
        config = TINY_ARCHS[ARCH]()
        config.initializer_range = std
        return config

    return load_model(f"tiny:{ARCH}", tiny_registry={**TINY_ARCHS, ARCH: build}, dtype=dtype)


def chunk_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """Boolean [s_q, s_k]: causal and within the query's chunk."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k <= q) & (k // chunk == q // chunk)


# ------------------------------------------------------------------------------ the op


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
@pytest.mark.parametrize("s_q,s_k", [(11, 11), (3, 11), (1, 9)])
def test_torch_attention_chunk_equals_explicit_mask(layout, s_q, s_k):
    """Queries bottom-right aligned (the last s_q of s_k positions), as with a KV cache."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s_q, 16, generator=g)
    k, v = torch.randn(2, 2, s_k, 16, generator=g), torch.randn(2, 2, s_k, 16, generator=g)
    mask = chunk_mask(torch.arange(s_k - s_q, s_k), torch.arange(s_k), 4)
    t = (lambda x: x) if layout == "bnsd" else (lambda x: x.transpose(1, 2))
    out = wb.torch_attention(t(q), t(k), t(v), is_causal=True, chunk_size=4, layout=layout)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    torch.testing.assert_close(t(out), ref, **TOL)
    plain = wb.torch_attention(t(q), t(k), t(v), is_causal=True, layout=layout)
    assert (t(plain) - ref).abs().max() > 1e-2  # the chunks hide keys here


def test_torch_attention_chunk_larger_than_keys_is_plain_causal():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out = wb.torch_attention(q, k, v, is_causal=True, chunk_size=6)
    torch.testing.assert_close(out, wb.torch_attention(q, k, v, is_causal=True), atol=0, rtol=0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        wb.torch_attention(q, k, v, is_causal=True, chunk_size=0)


def _hf_chunked_mask(model, hidden, positions):
    from transformers.masking_utils import create_chunked_causal_mask

    return create_chunked_causal_mask(
        config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
    )


def test_canonical_op_equals_hf_chunked_attention_module():
    """Llama 4's chunked layer (RoPE as complex rotation, QK L2-norm) with HF's own chunked mask vs
    the same projections through ``torch_attention(chunk_size=CHUNK)``."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    model = load_llama4(std=0.2).model
    assert model.config.layer_types[0] == "chunked_attention"
    attn = model.model.layers[0].self_attn
    b, s = 2, 11  # three chunks of 4
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, s, model.config.hidden_size, generator=g)
    positions = torch.arange(s).expand(b, s)
    freqs = model.model.rotary_emb(hidden, positions)
    mask = _hf_chunked_mask(model, hidden, positions)
    assert mask is not None and mask.dtype == torch.bool
    torch.testing.assert_close(mask[0, 0], chunk_mask(torch.arange(s), torch.arange(s), CHUNK), atol=0, rtol=0)

    def canonical(chunk_size):
        d = attn.head_dim
        q = attn.q_proj(hidden).view(b, s, -1, d)
        k = attn.k_proj(hidden).view(b, s, -1, d)
        v = attn.v_proj(hidden).view(b, s, -1, d)
        q, k = apply_rotary_emb(q, k, freqs)
        q, k = attn.qk_norm(q), attn.qk_norm(k)
        out = wb.torch_attention(q, k, v, is_causal=True, scale=attn.scaling, chunk_size=chunk_size, layout="bsnd")
        return attn.o_proj(out.reshape(b, s, -1))

    with torch.no_grad():
        ref, _ = attn(hidden, position_embeddings=freqs, attention_mask=mask)
        torch.testing.assert_close(canonical(CHUNK), ref, **TOL)
        assert (canonical(None) - ref).abs().max() > 100 * TOL["atol"]  # the chunks matter here


# ------------------------------------------------------------------------------ mask classification


def _mask_graph(make_mask):
    """An exported graph adding ``make_mask(q_pos, k_pos)`` (bool -> additive float) to x [b, 1, s, s]."""

    def f(x):
        s = x.shape[2]
        pos = torch.arange(s, device=x.device)
        m = make_mask(pos[:, None], pos[None, :])[None, None]
        return x + torch.zeros(m.shape, device=x.device).masked_fill(~m, float("-inf"))

    dims = ({0: torch.export.Dim.DYNAMIC, 2: torch.export.Dim.DYNAMIC, 3: torch.export.Dim.DYNAMIC},)
    gm = export_graph_module(f, (torch.randn(2, 1, 8, 8),), dynamic_shapes=dims)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and n.args[0] is x)
    return add.args[1], x.meta["val"].shape[2]


@pytest.mark.parametrize("chunk", [3, 4, 7])
def test_classify_chunked_mask(chunk):
    mask, s = _mask_graph(lambda q, k: (k <= q) & (k // chunk == q // chunk))
    assert classify_mask(mask, s) == MaskKind(is_causal=True, chunk_size=chunk)


@pytest.mark.parametrize(
    "near_miss",
    [
        lambda q, k: (k <= q) & ((k + 1) // 4 == (q + 1) // 4),  # chunks shifted by one position
        lambda q, k: (k // 4 == q // 4),  # chunked but not causal
        lambda q, k: (k <= q) & ((k // 4 == q // 4) | (q - k < 2)),  # chunk or window
    ],
)
def test_near_miss_chunked_masks_are_kept(near_miss):
    mask, s = _mask_graph(near_miss)
    assert classify_mask(mask, s) is None


def test_hf_chunked_mask_graph_is_classified():
    """HF's own mask graph, exported the way the pipeline exports Llama 4: the chunked layer gets
    ``chunk_size``, the full layer none, no mask kept."""
    bench = Workbench(load_llama4(), numerics=False)
    bench.run_to("match_attention_layout")
    args = [dict(named_args(n)) for n in bench.module.graph.nodes if n.target is wb.torch_attention.default]
    assert [(a["attn_mask"], a["is_causal"], a["chunk_size"], a["sliding_window"]) for a in args] == [
        (None, True, CHUNK, None),
        (None, True, None, None),
    ]


# ------------------------------------------------------------------------------ the cached ops


def paged_case(seq_lens, input_pos, num_prefill, chunk, hq=4, hkv=2, d=16, page_size=8, seed=0):
    """Op arguments of one step (cached slots random, unwritten ones NaN, shuffled pages) and the
    expected output: ``torch_attention(chunk_size=chunk)`` of each sequence's new queries over all
    its keys (the cached ones and the new ones)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(seq_lens), sum(seq_lens)
    need = [-(-(p + n) // page_size) for n, p in zip(seq_lens, input_pos)]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.full((b, max(need) + 1), int(perm[-1]), dtype=torch.int32)  # unused: the NaN page
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"))
    v_cache = k_cache.clone()
    q = torch.randn(1, t, hq, d, generator=g)
    k_new, v_new = torch.zeros(1, t, hkv, d), torch.zeros(1, t, hkv, d)
    expected = torch.empty(1, t, hq, d)
    used = start = 0
    scale = 1 / math.sqrt(d)
    for i, (n, ctx) in enumerate(zip(seq_lens, input_pos)):
        page_table[i, : need[i]] = perm[used : used + need[i]]
        used += need[i]
        keys, vals = torch.randn(ctx + n, hkv, d, generator=g), torch.randn(ctx + n, hkv, d, generator=g)
        for pos in range(ctx):
            page, slot = page_table[i, pos // page_size], pos % page_size
            k_cache[page, slot], v_cache[page, slot] = keys[pos], vals[pos]
        k_new[0, start : start + n], v_new[0, start : start + n] = keys[ctx:], vals[ctx:]
        expected[0, start : start + n] = wb.torch_attention(
            q[:, start : start + n], keys[None], vals[None], is_causal=True, scale=scale, chunk_size=chunk, layout="bsnd"
        )[0]
        start += n
    args = dict(
        q=q, k=k_new, v=v_new, k_cache=k_cache, v_cache=v_cache,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), input_pos=torch.tensor(input_pos, dtype=torch.int32),
        page_table=page_table, num_prefill=num_prefill, scale=scale,
    )
    return args, expected


# prefill from 0, chunked prefill crossing a chunk boundary, decodes at a chunk's first / middle / last slot
CACHED_CASES = {
    "mixed": ((13, 6, 1, 1, 1), (0, 9, 4, 6, 17), 2, 4),
    "prefill_only_chunk5": ((17, 9), (0, 3), 2, 5),
    "decode_only": ((1, 1, 1, 1), (0, 8, 11, 21), 0, 4),
    "decode_only_chunk3": ((1, 1, 1), (2, 3, 13), 0, 3),
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", sorted(CACHED_CASES))
def test_cached_attention_with_chunks_equals_torch_attention(backend, case):
    seq_lens, input_pos, num_prefill, chunk = CACHED_CASES[case]
    if backend == "cpu":
        from workbench.ops import cpu_kernels

        ok, why = cpu_kernels.is_available(torch.device("cpu"))
        if not ok:
            pytest.skip(why)
        cpu_kernels.load()
    op = getattr(wb, f"{backend}_cached_attention")
    args, expected = paged_case(seq_lens, input_pos, num_prefill, chunk)
    out = op(**args, chunk_size=chunk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    args, _ = paged_case(seq_lens, input_pos, num_prefill, chunk)
    unchunked = op(**args)
    assert (unchunked - expected).abs().max() > 1e-2  # the chunk hides keys in this step


def test_flashinfer_refuses_chunked_attention_by_name(monkeypatch):
    """At the backend choice (before any rewrite; FlashInfer's availability faked, the check reads
    only the graph's layer shapes) and when its op is called anyway."""
    from workbench.ops.backends import ATTENTION_BACKENDS
    from workbench.pipeline.transforms.caches.attention import _attention_nodes, layer_shapes
    from workbench.pipeline.transforms.caches.attention_backend import resolve_backend, unsupported_layers

    bench = Workbench(load_llama4(), numerics=False)
    bench.run_to("match_attention_layout")
    shapes = layer_shapes(_attention_nodes(bench.module))
    assert [s.chunk_size for s in shapes] == [CHUNK, None]
    fi = importlib.import_module("workbench.ops.attention.flashinfer_cached_attention")
    monkeypatch.setattr(fi, "is_available", lambda device=None: (True, "faked"))
    # head_dim 16 and fp32 are refused too; ask about a shape FlashInfer otherwise takes
    shapes = [s.__class__(s.layer, 64, 64, torch.bfloat16, False, s.chunk_size) for s in shapes]
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", torch.device("cpu"), shapes)
    assert "chunked local attention" in str(err.value) and "(layers [0])" in str(err.value)
    for name in ("torch", "cpu", "triton"):  # the backends that serve chunks
        assert unsupported_layers(ATTENTION_BACKENDS.get(name), shapes) == {}
    args, _ = paged_case((5,), (0,), 1, 4, d=64)
    with pytest.raises(ValueError, match="chunked local attention"):
        wb.flashinfer_cached_attention(
            **{k: v.to(torch.bfloat16) if k in ("q", "k", "v", "k_cache", "v_cache") else v for k, v in args.items()},
            chunk_size=4,
        )


# ------------------------------------------------------------------------------ Triton (interpreter)


def _interpreter_checks():
    tca = importlib.import_module("workbench.ops.attention.triton_cached_attention")

    def case(name, num_splits=None):
        def check():
            seq_lens, input_pos, num_prefill, chunk = CACHED_CASES[name]
            args, expected = paged_case(seq_lens, input_pos, num_prefill, chunk)
            out = tca.cached_attention_forward(**args, chunk_size=chunk, num_splits=num_splits)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

        return check

    def op_entry_point():
        args, expected = paged_case(*CACHED_CASES["mixed"][:3], 4)
        torch.testing.assert_close(wb.triton_cached_attention(**args, chunk_size=4), expected, atol=1e-5, rtol=1e-5)

    return {
        **{f"triton_{name}": case(name) for name in CACHED_CASES},
        "triton_decode_split2": case("decode_only", num_splits=2),
        "triton_op_entry_point": op_entry_point,
        "triton_generate_llama4_text": lambda: generate_with_triton_backend_equals_hf(
            ARCH, "insert_cached_attention", "triton_cached_attention", 2
        ),
    }


interpreter_results = interpreter_results_fixture(__file__, timeout=600)

TRITON_CASES = [f"triton_{n}" for n in CACHED_CASES] + [
    "triton_decode_split2",
    "triton_op_entry_point",
    "triton_generate_llama4_text",
]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ------------------------------------------------------------------------------ end to end

PROMPT_LENS = (3, 11, 19)  # within one chunk, and across two and five chunks of 4
NEW = 16


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cached_generation_equals_hf(backend):
    """3 prompts in one batch, 16 greedy tokens each, fp32: HF generate's tokens, every attention
    layer cached (``auto`` on CPU: the C++ kernel for decode steps where it builds)."""
    from test_runtime import _hf_greedy

    loaded = load_llama4()
    bench = Workbench(loaded, numerics=False, overrides={"insert_cached_attention.backend": backend})
    bench.run()
    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches == 2 and info.skip_reason is None, info
    assert "uncached_attention" not in info.details
    hist = bench.snapshots[-1].op_histogram
    assert not any(k.startswith("workbench.torch_attention.") for k in hist), hist
    assert "aten.scaled_dot_product_attention.default" not in hist

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, bench.ctx.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    for prompt, result in zip(prompts, out.results):
        want = _hf_greedy(loaded.model, prompt, NEW)
        assert len(set(want)) >= 8, want  # the tiny model's greedy tokens are not a constant run
        assert result.token_ids == want, (backend, len(prompt))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child_main(_interpreter_checks)
