"""The more dense and MoE families and the recent ones (``tiny_families/more_dense.py``, ``more_moe.py``,
``recent.py``): registered and checked, and their family-specific checks.

Each family's end-to-end run -- the whole default pipeline, every attention layer cached, greedy
tokens equal to HF ``generate`` -- is ``test_generate``'s sweep over every tiny arch; the oracle's
strength (HF's greedy tokens on the ``workbench check`` prompts hold >= 8 distinct ids, so a cache that
lost the past would change them) is ``test_check``'s. ``cached_greedy_equals_hf`` here is the same
check on one prompt, for the files that add a family-specific assertion after it.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _hf_greedy

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS
from workbench.models.tiny_families import more_dense, more_moe, recent
from workbench.onboarding.check import UNCACHED_RUNNER, check_prompts, hf_greedy, uncached_attention_left
from workbench.onboarding.registry import load_registry

ARCHS = sorted({**more_dense.ARCHS, **more_moe.ARCHS, **recent.ARCHS})
NEW = 8
ONE_THREAD = True  # see conftest.one_thread


def test_more_families_are_registered_and_checked():
    assert len(ARCHS) >= 27
    assert set(ARCHS) <= set(TINY_ARCHS)
    listed = {e.name for e in load_registry().entries}
    assert {f"tiny:{a}" for a in ARCHS} <= listed


def cached_greedy_equals_hf(arch: str, new: int = NEW) -> Workbench:
    """``tiny:<arch>`` through the default pipeline: HF's greedy tokens on the check prompts hold >= 8
    distinct ids (a strong oracle), every attention layer is cached, and ``new`` cached greedy tokens
    equal HF ``generate``'s on one prompt. Returns the finished workbench for family-specific checks."""
    loaded = load_model(f"tiny:{arch}", dtype="float32")
    # HF's tokens before the pipeline runs (its graph shares the eager model's weights).
    with torch.no_grad():
        distinct = [len(set(hf_greedy(loaded.model, p, 16))) for p in check_prompts(512)]
        prompt = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(5)).tolist()
        want = _hf_greedy(loaded.model, prompt, new)
    assert min(distinct) >= 8, f"HF's greedy tokens on the check prompts repeat: {distinct} distinct of 16"

    bench = Workbench(loaded, numerics=False)
    bench.run()
    info = bench.snapshot("insert_cached_attention").info
    assert info.num_matches > 0 and info.skip_reason is None, info
    assert uncached_attention_left(bench.snapshots) == {}

    out = bench.generate([prompt], max_new_tokens=new, stop_token_ids=[])
    assert not out.stats.cache.startswith(UNCACHED_RUNNER), out.stats.cache
    assert out.results[0].token_ids == want
    return bench

