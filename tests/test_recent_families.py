"""The recent decoder-only families (``tiny_families/recent.py``), each end to end through the default
pipeline: HF's greedy tokens are a strong oracle (>= 8 distinct ids), every attention layer is cached,
and cached greedy generation equals HF ``generate`` (``test_more_families.cached_greedy_equals_hf``)."""

import pytest

from workbench.models.tiny import TINY_ARCHS
from workbench.models.tiny_families import recent
from workbench.onboarding import load_registry

from test_more_families import cached_greedy_equals_hf

ARCHS = sorted(recent.ARCHS)
ONE_THREAD = True  # see conftest.one_thread


def test_recent_families_are_registered_and_checked():
    assert len(ARCHS) >= 12
    assert set(ARCHS) <= set(TINY_ARCHS)
    listed = {e.name for e in load_registry().entries}
    assert {f"tiny:{a}" for a in ARCHS} <= listed


@pytest.mark.parametrize("arch", ARCHS)
def test_recent_family_cached_greedy_equals_hf(arch):
    cached_greedy_equals_hf(arch)
