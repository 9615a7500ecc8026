"""The cache_init stage on tiny models: insert_cached_attention, insert_cached_residual_add,
initialize_cache / resize_kv_cache, and the transformers mode.

One module-scoped pipeline run on tiny:llama feeds most tests (the export is the slow part).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from workbench import Workbench
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.pipeline.config import ConfigError
from workbench.pipeline.context import PipelineContext
from workbench.pipeline.graph.copy import copy_module
from workbench.pipeline.graph.utils import op_histogram, run_shape_prop
from workbench.pipeline.interface import Stages, TransformConfig, TransformError
from workbench.runtime.probe import run_cached
from workbench.pipeline.transforms.caches.attention import InsertCachedAttention
from workbench.pipeline.transforms.caches.transformers_mode import HFCachedLM, transformers_mode_entries
from workbench.pipeline.matcher import export_graph_module
from workbench.runtime import CachedRunner, PageAllocator, runner_for
from workbench.runtime.kv_cache import PAGED, CacheFullError, CacheSpec, KVCacheConfig, add_specs
from workbench.runtime.scheduler import Request
from workbench.runtime.sequence_info import INPUT_KEY

ATTN, CACHED = "workbench.torch_attention.default", "workbench.torch_cached_attention.default"
EXPECTED_INPUTS = ["input_ids", "position_ids", "seq_lens", "input_pos", "page_table", "num_prefill",
                   "k_cache_0", "v_cache_0", "k_cache_1", "v_cache_1"]


ONE_THREAD = True  # see conftest.one_thread


@pytest.fixture(scope="module")
def wb(tiny_llama):
    # the reference cached attention: these tests check its graph, inputs and runner (the C++ 'cpu'
    # backend that auto picks on CPU is compared with it in tests/test_cpu_kernels.py)
    bench = Workbench(tiny_llama, overrides={"insert_cached_attention.backend": "torch"})
    bench.run()
    return bench


def _rmse_ratio(out, ref):
    return ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


def test_attention_becomes_cached_attention(wb):
    before = wb.snapshot("detect_hidden_states_for_capture").op_histogram
    snap = wb.snapshot("insert_cached_attention")
    assert before[ATTN] == 2 and ATTN not in snap.op_histogram and snap.op_histogram[CACHED] == 2
    assert snap.info.num_matches == 2 and snap.info.details["backend"] == "torch"
    gm = snap.module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.meta.get(INPUT_KEY, n.name) for n in placeholders] == EXPECTED_INPUTS
    assert all(n.meta.get("val") is not None for n in placeholders)
    assert str(placeholders[-1].meta["val"].shape[-2:]) == "torch.Size([2, 16])"  # [pages, page_size, Hkv, D]
    # Every node still carries metadata; a fresh shape propagation agrees.
    assert all("val" in n.meta for n in gm.graph.nodes if n.op not in ("output",))
    copy = copy_module(gm)
    run_shape_prop(copy)
    assert "torch_cached_attention" in gm.code and "num_prefill" in gm.code


def test_graph_stays_renderable(wb):
    from workbench.viz import render_graph
    from workbench.viz.labels import has_shape_meta

    gm = wb.snapshot("insert_cached_attention").module
    assert all(has_shape_meta(n) for n in gm.graph.nodes)
    src = render_graph(gm).source
    assert "torch_cached_attention" in src and "k_cache_0" in src
    assert render_graph(gm, collapsed=True).source


def test_numerics_probe_runs_through_the_cached_graph(wb):
    for key in ("insert_cached_attention", "initialize_cache", "resize_kv_cache", "cleanup_identity_dtype_cast"):
        n = wb.snapshot(key).numerics
        assert n.ok and n.rmse_ratio <= 1e-5 and n.top1_agreement == 1.0, (key, n)
    # Another probe shape through the same probe function.
    probe = make_batch(wb.ctx.vocab_size, 3, 23, seed=5)
    with torch.no_grad():
        out = wb.ctx.cache.probe(wb.module, probe)
        ref = CausalLMLogits(wb.loaded.model)(*probe.args)
    assert out.shape == ref.shape and _rmse_ratio(out, ref) <= 1e-5


def test_kv_cache_bytes_are_the_memory_delta(wb):
    init, resize = wb.snapshot("initialize_cache"), wb.snapshot("resize_kv_cache")
    bytes_per_page = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * page_size * Hkv * D * fp32
    assert init.info.details["num_pages"] == 191  # conservative: 2048/16 + 64 - 1 pages
    assert init.mem_delta == 191 * bytes_per_page == init.mem_after.cache_bytes and init.mem_warning is None
    new_pages = resize.info.details["num_pages"]
    assert new_pages == 64 * 512 // 16 + 1  # the 256 MiB budget is more than 64 full sequences (+ scratch page) need
    assert resize.mem_delta == (new_pages - 191) * bytes_per_page and resize.mem_warning is None
    assert wb.ctx.cache_bytes() == new_pages * bytes_per_page
    assert "resize_kv_cache" in {s.key for s in wb.snapshots if s.mem_delta}


def test_resize_runs_a_cpu_forward_only_when_asked(wb):
    assert "rss_growth_bytes" not in wb.snapshot("resize_kv_cache").info.details  # the default: none
    try:
        wb.configure("resize_kv_cache", forward_num_tokens=8)
        wb.run()
        d = wb.snapshot("resize_kv_cache").info.details
        assert d["forward_tokens"] == 8 and isinstance(d["rss_growth_bytes"], int)
    finally:
        wb.configure("resize_kv_cache", forward_num_tokens=None)
        wb.run()


def test_resize_follows_the_cpu_budget_and_rewinds(wb):
    try:
        wb.configure("resize_kv_cache", cpu_budget_bytes=10 * 8192 + 100)
        wb.run()
        cfg = wb.ctx.cache.config
        assert cfg.num_pages == 10 and wb.snapshot("resize_kv_cache").mem_delta == (10 - 191) * 8192
        out = wb.generate([[1, 2, 3]], max_new_tokens=4, stop_token_ids=[])
        assert len(out.results[0].token_ids) == 4
    finally:
        wb.configure("resize_kv_cache", cpu_budget_bytes=256 * 2**20)
        wb.run()
    assert wb.ctx.cache.config.num_pages == 2048 + 1  # 64 x 2048 tokens + scratch page


def test_bnsd_layout_gets_transposes(tiny_llama):
    bench = Workbench(tiny_llama, overrides={"match_attention_layout.attn_layout": "bnsd",
                                             "insert_cached_attention.backend": "torch"})
    bench.run_to("insert_cached_attention")
    hist = bench.snapshot("insert_cached_attention").op_histogram
    assert hist[CACHED] == 2 and hist.get("aten.transpose.int", 0) >= 8
    n = bench.snapshots[-1].numerics
    assert n.ok and n.rmse_ratio <= 1e-5, n


def test_backend_choice_errors():
    with pytest.raises(ConfigError, match="unknown attention backend"):
        Workbench("tiny:llama", overrides={"insert_cached_attention.backend": "cudnn"})
    # The pipeline device is CPU: flashinfer is refused whether or not it is installed and a GPU
    # is visible, so this holds on every machine.
    bench = Workbench("tiny:llama", numerics=False, overrides={"insert_cached_attention.backend": "flashinfer"})
    with pytest.raises(TransformError, match="flashinfer") as e:
        bench.run()
    assert "pip install flashinfer-python" in str(e.value) or "CUDA" in str(e.value)
    assert bench.status("insert_cached_attention") == "failed"


def test_flashinfer_refuses_shapes_it_has_no_kernels_for():
    from workbench.ops.backends import ATTENTION_BACKENDS as BACKENDS
    from workbench.pipeline.transforms.caches.attention_backend import unsupported_layers
    from workbench.pipeline.transforms.caches.attention import layer_shapes

    fi = BACKENDS["flashinfer"]
    assert "head_dim 16" in fi.unsupported(16, 16, torch.bfloat16, False)
    assert "float32" in fi.unsupported(64, 64, torch.float32, False)
    assert "sinks" in fi.unsupported(128, 128, torch.float16, True)
    assert fi.unsupported(64, 64, torch.bfloat16, False) is None
    assert BACKENDS["triton"].unsupported(16, 16, torch.float32, False) is None  # pads any head dim
    # On a graph: tiny:llama (head_dim 16, fp32) is refused for every layer, for both reasons.
    bench = Workbench("tiny:llama", numerics=False)
    bench.run_to("linear_weight_layout")
    gm = bench.snapshot("linear_weight_layout").module
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.workbench.torch_attention.default]
    refused = unsupported_layers(fi, layer_shapes(nodes))
    assert len(refused) == 1 and list(refused.values()) == [[0, 1]]
    assert "head_dim 16" in next(iter(refused))


def test_uncacheable_attention_is_refused():
    def f(q, k, v):
        return torch.ops.workbench.torch_attention(q, k, v, is_causal=False, layout="bsnd")

    gm = export_graph_module(f, [torch.randn(1, 4, 2, 8)] * 3)
    t = InsertCachedAttention(TransformConfig(stage=Stages.CACHE_INIT))
    with pytest.raises(ValueError, match="not causal"):
        t._apply(gm, PipelineContext.standalone())


def test_hidden_state_capture(tiny_llama):
    bench = Workbench(tiny_llama, numerics=False,
                      overrides={"detect_hidden_states_for_capture.eagle3_layers_to_capture": [0]})
    bench.run()
    snap = bench.snapshot("insert_cached_residual_add")
    assert snap.info.num_matches == 1 and snap.info.details["captured_layers"] == [0]
    cache = bench.ctx.cache.tensors["hidden_states_cache_0"]
    assert tuple(cache.shape) == (2048, 64)
    ids = [5, 9, 200, 3, 17]
    runner = runner_for(bench.module, bench.ctx)
    sched = runner.scheduler()
    req = Request(index=0, prompt=ids, max_new_tokens=1)
    sched.add(req)
    runner.step(sched.schedule(), sched)
    with torch.no_grad():
        ref = tiny_llama.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(cache[:5], ref, rtol=1e-5, atol=1e-4)  # fp32 round-off (the CPU kernels' sum order)


def test_transformers_mode(tiny_llama):
    bench = Workbench(tiny_llama, entries=transformers_mode_entries(page_size=8))
    bench.run()
    assert [s.key for s in bench.snapshots][:2] == ["detect_hf_attn_layers", "transformers_replace_cached_attn"]
    assert bench.snapshot("detect_hf_attn_layers").info.num_matches == 2
    assert isinstance(bench.module, HFCachedLM)
    assert bench.snapshot("initialize_cache").mem_delta > 0
    for s in bench.snapshots[1:]:
        assert s.numerics.ok and s.numerics.rmse_ratio <= 1e-5, (s.key, s.numerics)
    # The eager model is untouched (its attention implementation is switched only inside forward).
    assert tiny_llama.model.config._attn_implementation == "sdpa"
    prompts = [[1, 2, 3], list(range(40, 60)), [7]]
    got = bench.generate(prompts, max_new_tokens=12, stop_token_ids=[]).token_ids
    for p, toks in zip(prompts, got):
        ids = torch.tensor([p])
        ref = tiny_llama.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                        do_sample=False, eos_token_id=[], pad_token_id=0)
        assert toks == ref[0, len(p):].tolist()


def test_transformers_mode_refuses_graphs(wb):
    from workbench.pipeline.transforms.caches.transformers_mode import DetectHFAttnLayers

    t = DetectHFAttnLayers(TransformConfig(stage=Stages.CACHE_INIT))
    with pytest.raises(TypeError, match="un-exported"):
        t._apply(wb.module, wb.ctx)


# ------------------------------------------------------------------------------ cache pieces


def test_kv_cache_config_math():
    specs = (CacheSpec("k", PAGED, (2, 16)), CacheSpec("v", PAGED, (2, 16)), CacheSpec("h", "token", (64,), torch.float16))
    cfg = KVCacheConfig.sized(page_size=16, num_pages=10, dtype=torch.float32, max_batch_size=4, max_seq_len=100,
                        max_num_tokens=32, specs=specs)
    assert cfg.max_pages_per_seq == 7 and cfg.pages_to_fill() == 28 + 1 and cfg.token_capacity == 160
    assert cfg.bytes_per_page() == 2 * 16 * 2 * 16 * 4 and cfg.per_token_bytes() == 32 * 64 * 2
    assert cfg.total_bytes() == 10 * cfg.bytes_per_page() + cfg.per_token_bytes()
    with pytest.raises(ValueError, match="declared twice"):
        add_specs(specs, [CacheSpec("k", PAGED, (4, 16))])
    with pytest.raises(ValueError, match="num_pages"):
        cfg.with_pages(0)


def test_page_allocator():
    a = PageAllocator(5)
    assert a.allocate(1, 2) == [0, 1] and a.allocate(2, 2) == [2, 3] and a.num_free == 1
    with pytest.raises(CacheFullError, match="needs 2 pages"):
        a.allocate(3, 2)
    a.free(1)
    assert a.num_free == 3 and a.allocate(3, 3) == [0, 1, 4] and a.pages(3) == [0, 1, 4]


def test_cached_runner_checks_its_inputs(wb):
    cfg = wb.ctx.cache.config
    with pytest.raises(ValueError, match="no cache tensors"):
        CachedRunner(wb.module, {}, cfg)
    caches = dict(wb.ctx.cache.tensors)
    caches["k_cache_0"] = torch.empty(0)
    with pytest.raises(ValueError, match="released"):
        CachedRunner(wb.module, caches, cfg)
    assert isinstance(wb.module, fx.GraphModule) and set(op_histogram(wb.module)) >= {CACHED}
    with pytest.raises(KeyError, match="no value"):
        run_cached(wb.module, {})


def _tiny_llama_head_dim(head_dim: int):
    """tiny:llama with a head_dim FlashInfer builds kernels for (the default tiny head_dim is 16)."""
    from workbench.models import build_tiny_config

    def builder():
        config = build_tiny_config("llama")
        config.head_dim, config.hidden_size = head_dim, 4 * head_dim
        return config

    return {"llama": builder}


def _assert_diverge_only_at_near_ties(model, prompts, got, want, tol: float = 0.05):
    """Two bf16 greedy runs may part where the model's top two logits are within rounding of each
    other (a tiny random model's logits are nearly flat, so this happens at the first token too).
    Where `got` leaves `want`, the fp32 eager model on the same weights, fed the common prefix, must
    rate the two tokens within `tol` of its logit range; after that point the runs are not compared."""
    import copy

    ref = copy.deepcopy(model).float().eval()
    device = next(ref.parameters()).device
    for prompt, g, w in zip(prompts, got, want):
        k = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if k is None:
            continue
        ids = torch.tensor([prompt + w[:k]], device=device)
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0, -1].float()  # [V]
        span = float(logits.max() - logits.min())
        gap = float(logits[w[k]] - logits[g[k]])
        assert abs(gap) <= tol * span, (
            f"sequence {prompt} parts at token {k}: {g[k]} vs reference {w[k]}, fp32 logit gap {gap:.4f} "
            f"is no near-tie (logit range {span:.4f}); got {g}, want {w}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_is_the_gpu_default_and_replays_cuda_graphs(head_dim):
    """On a GPU with FlashInfer, the defaults (device/dtype/attention/compile auto) pick FlashInfer
    attention and CUDA graphs; the tokens match the torch backends on the same weights (bf16), and
    decode steps replay the captured graphs. The first FlashInfer calls JIT-compile (gpu_check's
    flashinfer-jit step builds them first)."""
    from workbench.ops.flashinfer_support import flashinfer_available
    from workbench.models import load_model

    ok, why = flashinfer_available("cuda")
    if not ok:
        pytest.skip(why)
    loaded = load_model("tiny:llama", tiny_registry=_tiny_llama_head_dim(head_dim))  # auto: cuda, bf16
    assert next(loaded.model.parameters()).dtype is torch.bfloat16
    prompts = [[i + 1, i + 5, i + 9, 7] for i in range(3)]
    ref = Workbench(loaded, numerics=False, overrides={"insert_cached_attention.backend": "torch",
                                                       "fuse_rmsnorm.backend": "torch",
                                                       "compile_model.backend": "torch-simple"})
    want = ref.generate(prompts, max_new_tokens=16, stop_token_ids=[]).token_ids
    fi = Workbench(loaded, overrides={"fuse_rmsnorm.backend": "flashinfer", "initialize_cache.max_batch_size": 8})
    got = fi.generate(prompts, max_new_tokens=16, stop_token_ids=[]).token_ids
    assert fi.snapshot("insert_cached_attention").info.details["backend"] == "flashinfer"
    assert fi.snapshot("compile_model").info.details["backend"] == "torch-cudagraph"
    assert fi.ctx.runner.replays > 0 and fi.snapshot("compile_model").info.details["check_max_abs_diff"] < 5e-2
    assert fi.snapshot("resize_kv_cache").numerics.rmse_ratio < 2e-2
    _assert_diverge_only_at_near_ties(loaded.model, prompts, got, want)
    fi.configure("compile_model", backend="torch-simple")  # FlashInfer planned per step, no graphs
    assert fi.generate(prompts, max_new_tokens=16, stop_token_ids=[]).token_ids == got
