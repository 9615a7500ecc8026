"""No silent fallback: attention the pattern matcher left uncanonicalized is reported by
insert_cached_attention (table note, details, CLI), generate says it ran uncached, and
require_cached_attention makes it an error; a graph that would be cached in some layers only is refused."""

from __future__ import annotations

import pytest
import torch

from workbench.api import Workbench
from workbench.pipeline.interface import TransformError

PROMPTS = [[5, 9, 11, 3], [7, 1, 2, 8, 4, 6, 10]]


def test_uncanonicalized_sdpa_is_reported_and_generates_uncached():
    wb = Workbench("tiny:llama", overrides={"match_sdpa_to_torch_attention.enabled": False})
    wb.run()
    snap = wb.snapshot("insert_cached_attention")
    left = snap.info.details["uncached_attention"]
    assert len(left) == 2 and all("SDPA the pattern matcher did not canonicalize" in why for why in left.values())
    note = wb.table().set_index("transform").loc["insert_cached_attention", "note"]
    assert "2 attention node(s) left without a KV cache" in note and "full re-forward" in note
    out = wb.generate(PROMPTS, max_new_tokens=5, stop_token_ids=[])
    assert out.stats.cache == "uncached (full re-forward)" and "uncached (full re-forward)" in str(out.stats)
    ref = Workbench("tiny:llama", numerics=False)
    ref.run()
    cached = ref.generate(PROMPTS, max_new_tokens=5, stop_token_ids=[])
    assert cached.stats.cache == "paged KV cache"
    assert out.token_ids == cached.token_ids  # slow, but right


def test_require_cached_attention_makes_it_an_error():
    wb = Workbench("tiny:llama", numerics=False, overrides={"match_sdpa_to_torch_attention.enabled": False,
                                                           "insert_cached_attention.require_cached_attention": True})
    with pytest.raises(TransformError, match="require_cached_attention=false"):
        wb.run()


def test_attention_cached_in_some_layers_only_is_refused():
    wb = Workbench("tiny:llama", numerics=False)
    wb.run_to("linear_weight_layout")  # the step before insert_cached_attention
    gm = wb.module
    first = next(n for n in gm.graph.nodes if n.target is torch.ops.workbench.torch_attention.default)
    # layer 0's attention back to a plain SDPA node (what the matcher leaves when it does not know a
    # variant; the layout is not SDPA's here, which does not matter: the transform must refuse first)
    q, k, v = first.args[:3]
    with gm.graph.inserting_before(first):
        sdpa = gm.graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v))
    sdpa.meta = dict(first.meta)
    first.replace_all_uses_with(sdpa)
    gm.graph.erase_node(first)
    with pytest.raises(TransformError, match="wrong results, not just slow"):
        wb.step()  # insert_cached_attention


def test_unmatched_sink_attention_is_reported():
    """gpt-oss's eager sink attention (cat the sink column, subtract the row max, softmax) with the
    matcher off is attention left uncached, not 'no attention at all'."""
    wb = Workbench("tiny:gpt_oss", numerics=False, overrides={"match_eager_attention.enabled": False})
    wb.run_to("insert_cached_attention")
    left = wb.snapshot("insert_cached_attention").info.details["uncached_attention"]
    assert len(left) == 2 and all("eager softmax over q @ k^T" in why for why in left.values())
