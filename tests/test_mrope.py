"""mRoPE (Qwen2.5-VL text stack): the table op against HF's rotary module, the per-sequence delta op,
export of ``tiny:qwen2_5_vl`` against HF eager, and the whole pipeline with and without
``initialize_mrope_delta_cache`` against HF greedy generation.

Tolerances: the table is the same fp32 products and cos/sin as HF's, so it is compared bit for bit;
graphs are compared with HF eager at fp32 round-off (1e-5; last-token logits of the cached runner,
up to ~10 in magnitude at the tiny models' init, 5e-5 absolute); generation token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from test_runtime import _hf_greedy

import workbench
import workbench.ops.rope.torch_mrope  # noqa: F401  (the rope package does not import it yet)
import workbench.pipeline.transforms.caches.mrope_delta  # noqa: F401  (nor the transforms package)
from workbench import Workbench
from workbench.models.build import materialise
from workbench.models.canonical.mrope import canonical_mrope_rotary, traceable_as_op
from workbench.models.export_contract import make_batch
from workbench.models.loaded import LoadedModel
from workbench.models.tiny import build_tiny_config
from workbench.models.tiny_families.mrope import MROPE_SECTION
from workbench.pipeline.config import load_default_yaml, resolve_pipeline
from workbench.pipeline.interface import GraphState, Stages, TransformConfig, TransformError
from workbench.pipeline.transforms.caches.mrope_delta import MROPE_DELTA_CACHE, InitializeMropeDeltaCache
from workbench.runtime.interface import SLOT, run_cached
from workbench.runtime.sequence_info import SequenceInfo

ONE_THREAD = True  # see conftest.one_thread
wb = torch.ops.workbench
KEY = "initialize_mrope_delta_cache"
MODEL_YAML = Path(workbench.__file__).parent / "models" / "configs" / "qwen2_5_vl.yaml"
NEW = 16


# ------------------------------------------------------------------------------ helpers


def tiny_qwen2_5_vl(seed: int = 0) -> LoadedModel:
    """``tiny:qwen2_5_vl`` with seeded random weights.

    Built here rather than by ``load_model``: the factory builds ``AutoModelForCausalLM``, which has
    no class for Qwen2.5-VL configs (the model is image-text-to-text). Same meta build + init as
    ``models.build``; ``config`` is the text config, which holds ``vocab_size``.
    """
    from transformers import AutoModelForImageTextToText

    config = build_tiny_config("qwen2_5_vl")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model = materialise(model, torch.device("cpu"), seed).eval().requires_grad_(False)
    return LoadedModel(spec="tiny:qwen2_5_vl", model=model, config=model.config.get_text_config(),
                       tokenizer=None, source=f"random init (seed={seed})")


def pipeline_tree() -> dict:
    """default.yaml, with ``initialize_mrope_delta_cache`` (disabled) placed right before
    ``initialize_cache`` when default.yaml does not list it yet."""
    tree = load_default_yaml()
    items = list(tree["transforms"].items())
    if KEY not in tree["transforms"]:
        at = [k for k, _ in items].index("initialize_cache")
        tree["transforms"] = dict(items[:at] + [(KEY, {"stage": "cache_init", "enabled": False})] + items[at:])
    return tree


def bench_for(loaded: LoadedModel, yaml_extra=(), **overrides) -> Workbench:
    entries = resolve_pipeline(list(yaml_extra), overrides, base=pipeline_tree())
    return Workbench(loaded, entries=entries, numerics=False)


def count(gm: torch.fx.GraphModule, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op.default)


def snapshot(bench: Workbench, key: str):
    return next(s for s in bench.snapshots if s.key == key)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 11)]


@pytest.fixture(scope="module")
def loaded():
    return tiny_qwen2_5_vl()


@pytest.fixture(scope="module")
def plain_bench(loaded):
    """The default pipeline: the delta cache stays disabled."""
    bench = bench_for(loaded)
    bench.run()
    return bench


@pytest.fixture(scope="module")
def delta_bench(loaded):
    """The pipeline with the model's YAML, which enables the delta cache."""
    bench = bench_for(loaded, [MODEL_YAML])
    bench.run()
    return bench


# ------------------------------------------------------------------------------ the ops


def hf_rotary():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    return hf, hf.Qwen2_5_VLRotaryEmbedding(build_tiny_config("qwen2_5_vl").get_text_config())


def test_table_and_rotation_equal_hf_with_unequal_sections():
    hf, rot = hf_rotary()
    assert list(rot.mrope_section) == MROPE_SECTION and len(set(MROPE_SECTION)) > 1
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (3, 2, 7), generator=g)  # temporal, height, width rows all differ
    x = torch.randn(2, 7, 64, generator=g)
    q, k = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    cos, sin = wb.torch_mrope_cos_sin(pos, rot.inv_freq, MROPE_SECTION, rot.attention_scaling)
    hf_cos, hf_sin = rot(x, pos)
    if hasattr(hf, "apply_multimodal_rotary_pos_emb"):  # transformers that select sections in the attention
        ref_q, ref_k = hf.apply_multimodal_rotary_pos_emb(q, k, hf_cos, hf_sin, MROPE_SECTION)
    else:  # transformers 5.2x: the rotary module selects them; the attention rotates as Llama does
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
        ref_q, ref_k = hf.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    out_q, out_k = wb.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 1)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    # the sections matter: the temporal row alone gives another table
    assert not torch.equal(wb.torch_mrope_cos_sin(pos[0], rot.inv_freq, MROPE_SECTION, 1.0)[0], cos)


def test_identical_sections_are_the_plain_rope_table():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    _, rot = hf_rotary()
    pos = torch.arange(5, 12).expand(2, 7)  # text: [b, s], one position for all three sections
    cos, sin = wb.torch_mrope_cos_sin(pos, rot.inv_freq, MROPE_SECTION, 1.0)
    assert cos.shape == (2, 7, 16) and cos.dtype == torch.float32
    cos3, sin3 = wb.torch_mrope_cos_sin(pos.expand(3, 2, 7), rot.inv_freq, MROPE_SECTION, 1.0)
    assert torch.equal(cos, cos3) and torch.equal(sin, sin3)
    plain = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    ref_cos, ref_sin = plain(torch.zeros(2, 7, 64), pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_canonical_forward_equals_hf_and_leaves_runtime_recomputed_tables_to_hf():
    _, rot = hf_rotary()
    x, pos = torch.randn(1, 5, 64), torch.randint(0, 50, (3, 1, 5))
    ref = rot(x, pos)
    assert traceable_as_op(rot) is None
    assert all(torch.equal(a, b) for a, b in zip(canonical_mrope_rotary(rot, x, pos), ref))
    rot.rope_type = "dynamic"  # inv_freq recomputed from the positions at run time: HF's own forward
    assert "recomputes inv_freq" in traceable_as_op(rot)
    assert all(torch.equal(a, b) for a, b in zip(canonical_mrope_rotary(rot, x, pos), ref))


def test_table_refuses_bad_sections_and_positions():
    inv_freq = torch.rand(8)
    with pytest.raises(ValueError, match="mrope_section"):
        wb.torch_mrope_cos_sin(torch.zeros(2, 3, dtype=torch.long), inv_freq, [2, 2, 2], 1.0)
    with pytest.raises(ValueError, match=r"\[3, b, s\]"):
        wb.torch_mrope_cos_sin(torch.zeros(2, 2, 3, dtype=torch.long), inv_freq, [2, 3, 3], 1.0)


def expected_deltas(lens, slots, cache, num_tokens):
    """Per token: the delta of its sequence's slot (0 for tokens past the batch), by plain loops."""
    out = []
    for n, slot in zip(lens, slots):
        out += [int(cache[slot, 0])] * n
    return out + [0] * (num_tokens - len(out))


def test_delta_positions_follow_each_tokens_sequence_slot():
    cache = torch.tensor([[10], [20], [30], [40], [50]])  # [num_slots, 1] int64
    lens, slots = [3, 1, 2], [2, 0, 4]
    seq_lens, slot_idx = torch.tensor(lens, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    for num_tokens in (6, 8):  # 8: two padding tokens past the batch keep their positions
        pos = torch.arange(num_tokens)[None].expand(3, 1, num_tokens)  # [3, 1, T]: the runtime's layout
        out = wb.torch_mrope_delta_positions(pos, cache, seq_lens, slot_idx)
        want = torch.tensor(expected_deltas(lens, slots, cache, num_tokens))
        assert out.shape == pos.shape and out.dtype == torch.int64
        assert torch.equal(out, pos + want)
    # the probe's layout: [b, s] rows are b sequences of s tokens
    pos = torch.arange(4).expand(2, 4)
    out = wb.torch_mrope_delta_positions(pos, cache, torch.tensor([4, 4], dtype=torch.int32),
                                         torch.tensor([3, 1], dtype=torch.int32))
    assert out.tolist() == [[40, 41, 42, 43], [20, 21, 22, 23]]


# ------------------------------------------------------------------------------ export


def test_export_matches_hf_eager(plain_bench, loaded):
    gm = snapshot(plain_bench, "load_weights").module
    assert count(gm, wb.torch_mrope_cos_sin) == 1  # one table, shared by both layers as in HF
    assert count(gm, wb.torch_rope_with_explicit_cos_sin) == 2  # the rotation: the usual rope matcher
    assert snapshot(plain_bench, "match_rope_pattern").info.num_matches == 2
    g = torch.Generator().manual_seed(1)
    for b, s, first in ((2, 7, 0), (1, 5, 11)):  # a second shape, and positions not starting at 0
        ids = torch.randint(0, 512, (b, s), generator=g)
        pos = torch.arange(first, first + s).expand(b, s)
        with torch.no_grad():
            assert_close(gm(ids, pos), loaded.model(input_ids=ids, position_ids=pos).logits, rtol=1e-5, atol=1e-5)


def test_without_the_canonical_patch_export_still_matches_but_the_delta_cache_refuses(loaded):
    bench = bench_for(loaded, **{"export_to_gm.patches": {"canonical_mrope_rotary": False}})
    bench.run_to("load_weights")
    gm = bench.module
    assert count(gm, wb.torch_mrope_cos_sin) == 0
    ids, pos = make_batch(512, 2, 6, seed=2).args
    with torch.no_grad():
        assert_close(gm(ids, pos), loaded.model(input_ids=ids, position_ids=pos).logits, rtol=1e-5, atol=1e-5)
    transform = InitializeMropeDeltaCache(TransformConfig(stage=Stages.CACHE_INIT))
    with pytest.raises(TransformError, match="no mRoPE table"):
        transform(gm, None, GraphState())


# ------------------------------------------------------------------------------ pipeline + generate


def test_generate_equals_hf_greedy(plain_bench, loaded):
    assert snapshot(plain_bench, KEY).status == "skipped"  # disabled unless the model's YAML enables it
    ps = prompts()
    out = plain_bench.generate(ps, max_new_tokens=NEW, stop_token_ids=[])
    assert [r.token_ids for r in out.results] == [_hf_greedy(loaded.model, p, NEW) for p in ps]


def test_delta_cache_with_zero_deltas_changes_nothing(delta_bench, loaded):
    snap = snapshot(delta_bench, KEY)
    assert snap.status == "done" and snap.info.num_matches == 1
    spec = next(s for s in delta_bench.ctx.cache.specs if s.name == MROPE_DELTA_CACHE)
    assert (spec.kind, spec.shape, spec.dtype) == (SLOT, (1,), torch.int64)
    cfg = delta_bench.ctx.cache.config
    delta = delta_bench.ctx.cache.tensors[MROPE_DELTA_CACHE]
    assert delta.shape == (cfg.max_batch_size + 1, 1) and delta.dtype == torch.int64 and not delta.any()
    gm = snapshot(delta_bench, KEY).module
    table = next(n for n in gm.graph.nodes if n.target is wb.torch_mrope_cos_sin.default)
    assert table.args[0].target is wb.torch_mrope_delta_positions.default
    # the numerics probe's path (b fresh prefill sequences) and generation both equal HF
    batch = make_batch(512, 2, 6, seed=4)
    with torch.no_grad():
        assert_close(delta_bench.ctx.cache.probe(delta_bench.module, batch),
                     loaded.model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits,
                     rtol=1e-5, atol=1e-5)
    ps = prompts()
    out = delta_bench.generate(ps, max_new_tokens=NEW, stop_token_ids=[])
    assert [r.token_ids for r in out.results] == [_hf_greedy(loaded.model, p, NEW) for p in ps]


def test_a_slots_delta_shifts_only_its_sequences_positions(delta_bench, loaded):
    """A prefills with delta 0; then its slot's delta becomes 7 (what a vision prompt's text continues
    with) and A decodes in a mixed step beside B's prefill, then both decode. A's new tokens must sit at
    positions shifted by 7 (HF eager at those explicit positions), B's at plain positions.

    RoPE is relative: a delta added to every token of a sequence, prefill included, would not change its
    logits at all -- so the test shifts A between steps, where the shift shows.
    """
    ctx, module = delta_bench.ctx, delta_bench.module
    cfg, caches = ctx.cache.config, ctx.cache.tensors
    pb, pa = prompts()  # A: 11 tokens, B: 5
    per_seq = cfg.pages_for(len(pa) + 2)
    pages_a, pages_b = list(range(per_seq)), list(range(per_seq, 2 * per_seq))
    slot_a, slot_b, shift = 1, 0, 7
    info = SequenceInfo.from_config(cfg)

    def step(tokens, past, pages, num_prefill, slots):
        info.set_batch(tokens, past, pages, num_prefill=num_prefill, page_size=cfg.page_size, slots=slots)
        with torch.no_grad():
            return run_cached(module, {**info.inputs(), **caches}).reshape(len(tokens), -1)

    def hf_last(tokens, positions):
        with torch.no_grad():
            return loaded.model(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions])).logits[0, -1]

    try:
        ta = int(step([pa], [0], [pages_a], 1, [slot_a])[0].argmax())
        caches[MROPE_DELTA_CACHE][slot_a] = shift
        mixed = step([pb, [ta]], [0, len(pa)], [pages_b, pages_a], 1, [slot_b, slot_a])  # B prefill, A decode
        tb, ta2 = int(mixed[0].argmax()), int(mixed[1].argmax())
        decode = step([[tb], [ta2]], [len(pb), len(pa) + 1], [pages_b, pages_a], 0, [slot_b, slot_a])
    finally:
        caches[MROPE_DELTA_CACHE].zero_()
    n = len(pa)
    plain_a = list(range(n + 2))
    shifted_a = list(range(n)) + [n + shift, n + 1 + shift]
    assert_close(mixed[0], hf_last(pb, list(range(len(pb)))), rtol=1e-5, atol=5e-5)
    assert_close(mixed[1], hf_last(pa + [ta], shifted_a[:n + 1]), rtol=1e-5, atol=5e-5)
    assert_close(decode[0], hf_last(pb + [tb], list(range(len(pb) + 1))), rtol=1e-5, atol=5e-5)
    assert_close(decode[1], hf_last(pa + [ta, ta2], shifted_a), rtol=1e-5, atol=5e-5)
    # the shift is visible: at plain positions A's logits are different
    assert (mixed[1] - hf_last(pa + [ta], plain_a[:n + 1])).abs().max() > 1e-3
    assert (decode[1] - hf_last(pa + [ta, ta2], plain_a)).abs().max() > 1e-3
