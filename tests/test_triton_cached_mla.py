"""``triton_cached_mla`` (MLA over a paged latent cache, decode rows absorbed in Triton) against
``torch_cached_mla``, the backend choice of ``insert_cached_mla_attention``, and CUDA-graph capture.

The kernels run under ``TRITON_INTERPRET=1`` in one child process (``tests/triton_child.py``):

* ``schedule*``: one step sequence -- two fresh prefills, a chunked prefill beside a prefill and a
  decode row, decode-only steps of different lengths, a new sequence on a finished one's pages
  (stale latents under it), chunked prefill over them, a lone decode row -- through both ops on
  their own caches (shuffled, non-contiguous pages; NaN in every unwritten slot): every step's
  output and the written cache rows equal the torch op's. Two shapes: 4 heads (one padded head
  block, r = 32, dr = 8) and 20 heads (two head blocks, r = 48 and dr = 12 not powers of two, pages
  of 3 rows so a key block spans pages); ``schedule_split_keys``: the second with split-K forced (3).
* ``bf16_decode``: a bf16 decode-only step vs the torch op (which decodes in fp32).
* ``deepseek_v2_generate``: ``tiny:deepseek_v2`` through the whole pipeline with
  ``insert_cached_mla_attention.backend: triton``: 2 ``triton_cached_mla`` nodes, HF's greedy
  tokens, and nothing MLA among the graph's CUDA-graph blockers; ``deepseek_v3_generate``: the same
  tokens check on the custom DeepSeek-V3 model.

Tolerance: fp32 -- the kernel sums the same fp32 products as the torch decode rows in another
order (blocked online softmax, the absorbed query from a batched matmul): 1e-5 relative to the
largest output (O(1) outputs; a wrong page, a stale row, a swapped k/v split move them by O(0.1)).
bf16 -- q_lat and the context are rounded to bf16 once each before the fp32 attention / the
projection: 2e-2 relative (a few bf16 ulps).

Outside the child: the sm_90 ahead-of-time compile of both kernels at DeepSeek-V2 sizes, the
backend choice (auto: triton on CUDA, torch elsewhere; unknown names refused), and the capture
check of whole graphs by op tags (a dense MLA model: no blocker at all, so compile_model's auto
picks CUDA graphs).
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from triton_child import child_main, generate_with_triton_backend_equals_hf, interpreter_results_fixture

import workbench.ops.mla  # noqa: F401
from workbench.ops.capture import capture_blockers

wb = torch.ops.workbench
ONE_THREAD = True  # see conftest.one_thread
HAS_TRITON = importlib.util.find_spec("triton") is not None
REL = 1e-5
REL_BF16 = 2e-2


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _weights(n, dn, dv, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n * (dn + dv), r, generator=g) / math.sqrt(r)


def _tokens(s, n, dn, dr, r, seed):
    """One sequence's q_nope [1, s, n, dn], q_pe [1, s, n, dr], latent [1, s, r], kpe [1, s, 1, dr]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, s, n, dn, generator=g), torch.randn(1, s, n, dr, generator=g),
            torch.randn(1, s, r, generator=g), torch.randn(1, s, 1, dr, generator=g))


def _step(op, cache, w, items, tokens, pages, max_pages, scale, dtype=torch.float32):
    """One mixed step of ``op``: items [(seq, input_pos, n_new)], prefills (n_new > 1) first."""
    num_prefill = sum(1 for _, _, n in items if n > 1)
    parts = [[x[0, p: p + n] for x in tokens[s]] for s, p, n in items]
    flat = [torch.cat([pt[j] for pt in parts])[None].to(dtype) for j in range(4)]
    table = torch.tensor([pages[s] + [0] * (max_pages - len(pages[s])) for s, _, _ in items], dtype=torch.int32)
    i32 = dict(dtype=torch.int32)
    return op(*flat, w.to(dtype), cache, torch.tensor([n for _, _, n in items], **i32),
              torch.tensor([p for _, p, _ in items], **i32), table, num_prefill, scale)


def check_schedule(n=4, dn=16, dr=8, r=32, dv=12, page_size=4):
    """The step schedule of the module docstring through both ops: outputs and caches equal."""
    w = _weights(n, dn, dv, r)
    lens = {"A": 11, "B": 7, "C": 6, "D": 8}
    tokens = {s: _tokens(k, n, dn, dr, r, seed=10 + i) for i, (s, k) in enumerate(lens.items())}
    max_pages = -(-11 // page_size)
    num_pages = 4 * max_pages + 2
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)).tolist()
    pages = {s: perm[i * max_pages: (i + 1) * max_pages] for i, s in enumerate("ABC")}
    caches = {op: torch.full((num_pages, page_size, r + dr), float("nan")) for op in ("torch", "triton")}
    steps = [
        [("A", 0, 3), ("B", 0, 5)],                     # two fresh prefills
        [("A", 3, 5), ("C", 0, 4), ("B", 5, 1)],        # chunked prefill, prefill, decode
        [("C", 4, 1), ("B", 6, 1), ("A", 8, 1)],        # decode only, different lengths
        "D takes B's pages",
        [("D", 0, 2), ("A", 9, 1), ("C", 5, 1)],        # fresh prefill + decodes
        [("D", 2, 5), ("A", 10, 1)],                    # chunked prefill over stale latents
        [("D", 7, 1)],                                  # one decode row
    ]
    for k, items in enumerate(steps):
        if isinstance(items, str):
            pages["D"] = pages.pop("B")
            continue
        ref = _step(wb.torch_cached_mla, caches["torch"], w, items, tokens, pages, max_pages, 0.3)
        out = _step(wb.triton_cached_mla, caches["triton"], w, items, tokens, pages, max_pages, 0.3)
        assert out.shape == ref.shape and torch.isfinite(out).all(), f"step {k}"
        assert _rel_err(out, ref) <= REL, f"step {k}: {_rel_err(out, ref)}"
    written = ~torch.isnan(caches["torch"])
    assert torch.equal(written, ~torch.isnan(caches["triton"]))  # the same slots written, the rest untouched
    torch.testing.assert_close(caches["triton"][written], caches["torch"][written], rtol=0, atol=0)


def check_bf16_decode(n=20, dn=16, dr=8, r=32, dv=12, page_size=4):
    """A bf16 decode-only step (three sequences of different lengths) vs the torch op."""
    w = _weights(n, dn, dv, r)
    tokens = {s: _tokens(k, n, dn, dr, r, seed=20 + i) for i, (s, k) in enumerate({"A": 9, "B": 3, "C": 14}.items())}
    pages = {"A": [5, 1, 7], "B": [2], "C": [9, 0, 4, 8]}
    outs = []
    for op in (wb.torch_cached_mla, wb.triton_cached_mla):
        cache = torch.zeros(10, page_size, r + dr, dtype=torch.bfloat16)
        _step(op, cache, w, [("A", 0, 8), ("B", 0, 2), ("C", 0, 13)], tokens, pages, 4, 0.3, torch.bfloat16)
        outs.append(_step(op, cache, w, [("A", 8, 1), ("B", 2, 1), ("C", 13, 1)], tokens, pages, 4, 0.3,
                          torch.bfloat16))
    ref, out = outs
    assert out.dtype == torch.bfloat16 and _rel_err(out, ref) <= REL_BF16, _rel_err(out, ref)


def _schedule_split_keys():
    """The schedule with the keys of every decode row cut into 3 ranges (split-K, what a GPU picks
    for few rows and long caches) merged by log-sum-exp; late splits of short rows are empty."""
    from workbench.ops.mla import triton_cached_mla as op_module

    original = op_module.decode_splits
    op_module.decode_splits = lambda *a: 3
    try:
        check_schedule(n=20, dn=24, dr=12, r=48, dv=20, page_size=3)
    finally:
        op_module.decode_splits = original


def _refuses_bad_metadata():
    """A decode-only step is checked from shapes alone: two tokens for one sequence, or int64
    metadata (what the kernels cannot load), are refused by name."""
    toks = _tokens(2, 4, 16, 8, 32, seed=0)
    w, cache = _weights(4, 16, 12, 32), torch.zeros(4, 4, 40)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one token per sequence"):
        wb.triton_cached_mla(*toks, w, cache, one, one * 0, one[None] * 0, 0, 0.3)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        wb.triton_cached_mla(*toks, w, cache, torch.ones(2, dtype=torch.int64), one.repeat(2), one.repeat(2, 1), 0, 0.3)


def _deepseek_v2_generate():
    """tiny:deepseek_v2 with the Triton MLA backend: HF's tokens; no MLA node blocks capture."""
    from workbench import Workbench
    from workbench.models import load_model

    generate_with_triton_backend_equals_hf("deepseek_v2", "insert_cached_mla_attention", "triton_cached_mla", 2,
                                           prompt_lens=(5, 13), new_tokens=6)
    bench = Workbench(load_model("tiny:deepseek_v2"), numerics=False,
                      overrides={"insert_cached_mla_attention.backend": "triton"})
    bench.run()
    final = bench.snapshots[-1]
    assert final.key == "compile_model" and final.op_histogram.get("workbench.triton_cached_mla.default") == 2
    blockers = capture_blockers(final.module)
    # tiny:deepseek_v2's MoE layer (torch_moe_fused: host-read expert dispatch) is its only blocker
    assert all("torch_moe" in why for why in blockers.values()), blockers


def _interpreter_checks() -> dict:
    return {
        "schedule": check_schedule,
        "schedule_two_head_blocks": lambda: check_schedule(n=20, dn=24, dr=12, r=48, dv=20, page_size=3),
        "schedule_split_keys": _schedule_split_keys,
        "bf16_decode": check_bf16_decode,
        "refuses_bad_metadata": _refuses_bad_metadata,
        "deepseek_v2_generate": _deepseek_v2_generate,
        # the custom canonical-op DeepSeek-V3 model (4 MLA layers, interleaved rope): HF's tokens too
        "deepseek_v3_generate": lambda: generate_with_triton_backend_equals_hf(
            "deepseek_v3", "insert_cached_mla_attention", "triton_cached_mla", 4, prompt_lens=(5, 13), new_tokens=6),
    }


TRITON_CASES = list(_interpreter_checks())
interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_triton_unavailable_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    toks = _tokens(1, 4, 16, 8, 32, seed=0)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="insert_cached_mla_attention.backend=torch"):
        wb.triton_cached_mla(*toks, _weights(4, 16, 12, 32), torch.zeros(2, 4, 40), one, one * 0, one[None] * 0, 0, 0.3)


def test_op_carries_no_host_sync_tag():
    """What compile_model's capture check reads: the Triton op is capturable, the torch one is not."""
    assert torch.Tag.cudagraph_unsafe not in wb.triton_cached_mla.default.tags
    assert torch.Tag.cudagraph_unsafe in wb.torch_cached_mla.default.tags


def test_backend_choice(monkeypatch):
    """MLA chooses through its backend table (``ops/backends.py`` ``MLA_BACKENDS.choose``), like
    attention: auto is Triton on CUDA where it runs, else the torch reference, saying what it passed over."""
    from workbench.ops.mla import triton_cached_mla
    from workbench.pipeline.transforms.caches import mla

    assert mla.pick_mla_backend(None, torch.device("cpu"))[0] == "torch"
    assert mla.pick_mla_backend("auto", torch.device("cpu"))[0] == "torch"
    assert mla.pick_mla_backend("torch", torch.device("cpu")) == ("torch", "torch (requested)")
    monkeypatch.setattr(triton_cached_mla, "is_available", lambda d: (True, ""))
    assert mla.pick_mla_backend("auto", torch.device("cuda"))[0] == "triton"
    assert mla.pick_mla_backend("triton", torch.device("cuda")) == ("triton", "triton (requested)")
    with pytest.raises(ValueError, match="no 'flashinfer' backend.*'triton'"):
        mla.pick_mla_backend("flashinfer", torch.device("cuda"))
    monkeypatch.setattr(triton_cached_mla, "is_available", lambda d: (False, "triton is not installed"))
    assert mla.pick_mla_backend("auto", torch.device("cuda")) == (
        "torch", "auto on cuda: torch (passed over: triton: triton is not installed)")
    with pytest.raises(RuntimeError, match="'triton' cannot run.*triton is not installed.*Pick backend 'torch'"):
        mla.pick_mla_backend("triton", torch.device("cuda"))


def _dense_deepseek_v2():
    """tiny:deepseek_v2 with every layer dense (no MoE): MLA is the only cached op."""
    from transformers import DeepseekV2Config

    from workbench.models.tiny_families.mla import MLA_SIZES

    return DeepseekV2Config(**{**MLA_SIZES, "first_k_dense_replace": MLA_SIZES["num_hidden_layers"]},
                            q_lora_rank=None)


def test_dense_mla_graph_with_the_triton_op_has_no_capture_blocker(monkeypatch):
    """The cached graph of a dense MLA model (torch backend, built on this CPU) with its
    torch_cached_mla nodes swapped for triton_cached_mla (same schema: what backend triton writes
    on a GPU): no blocker, so compile_model's auto on CUDA resolves to CUDA graphs."""
    from workbench import Workbench
    from workbench.models import load_model
    from workbench.pipeline.transforms.compile.compile_model import resolve_auto

    loaded = load_model("tiny:deepseek_v2_dense", tiny_registry={"deepseek_v2_dense": _dense_deepseek_v2})
    bench = Workbench(loaded, numerics=False)
    bench.run_to("resize_kv_cache")
    gm = bench.snapshot("resize_kv_cache").module
    before = capture_blockers(gm)
    assert len(before) == 2 and all("torch_cached_mla" in why for why in before.values()), before
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.target is wb.torch_cached_mla.default:
            node.target = wb.triton_cached_mla.default
    swapped = torch.fx.GraphModule(gm, graph)
    assert capture_blockers(swapped) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA-graph backends can run
    assert resolve_auto(torch.device("cuda"), capture_blockers(swapped))[0] == "torch-cudagraph"
    assert resolve_auto(torch.device("cuda"), before)[0] == "torch-simple"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_compile_for_hopper():
    """The interpreter skips the compiler's checks: compile the decode kernel for sm_90 down to a
    cubin at DeepSeek-V2 sizes (r = 512, dr = 64, 128 heads; bf16 and fp32 caches), within shared
    memory. The cache write (``append_paged_kv``) is compiled at these sizes with the attention
    kernels (``test_triton_cached_attention``)."""
    import triton
    from triton.runtime.jit import JITFunction

    from workbench.ops.mla import triton_cached_mla as op_module
    from workbench.ops.mla import triton_mla_kernels

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    decode = triton_mla_kernels.decode_kernel()
    if not isinstance(decode, JITFunction):
        pytest.skip("the kernels were decorated under TRITON_INTERPRET=1 in this process")
    int_ptrs = ("input_pos_ptr", "page_table_ptr")
    bf16, fp32 = ("bf16", torch.bfloat16), ("fp32", torch.float32)
    # DeepSeek-V2's sizes in bf16 and fp32, and tiny:deepseek_v2's (r = 32, dr = 8 padded to 16)
    for (dtype, torch_dtype), r, dr, r_pad, dr_pad in ((bf16, 512, 64, 512, 64), (fp32, 512, 64, 512, 64),
                                                       (bf16, 32, 8, 32, 16)):
        cfg = op_module._launch_config(torch.device("cuda"), torch_dtype, r_pad)
        launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        sizes = dict(R=r, DR=dr, R_PAD=r_pad, DR_PAD=dr_pad, PAGE_SIZE=64)
        cases = (
            (decode, dict(**sizes, H_BLOCK=16, FP32_DOT=dtype == "fp32", NUM_SPLITS=1, **cfg), launch),
            (decode, dict(**sizes, H_BLOCK=16, FP32_DOT=dtype == "fp32", NUM_SPLITS=8, **cfg), launch),
        )
        for kernel, constexprs, options in cases:
            sig = {}
            for name in kernel.arg_names:
                if name in constexprs:
                    sig[name] = "constexpr"
                elif name in int_ptrs:
                    sig[name] = "*i32"
                elif name in ("ctx_ptr", "part_lse_ptr"):
                    sig[name] = "*fp32"
                elif name.endswith("_ptr"):
                    sig[name] = f"*{dtype}"
                elif name == "scale_log2":
                    sig[name] = "fp32"
                else:
                    sig[name] = "i32"
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            assert compiled.metadata.shared <= 227 * 1024, (kernel.__name__, dtype, compiled.metadata.shared)


if __name__ == "__main__":
    child_main(_interpreter_checks)
