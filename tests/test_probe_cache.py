"""The probe cache (``pipeline/probe_cache.py``): a repeat run of the same model and config reads
the numerics probes an earlier run computed -- the same numbers -- and anything that could change
a probe's result (the weights, a transform's config, code the workbench does not own) runs it
again."""

import pytest
import torch

from workbench import Workbench
from workbench.pipeline.probe_cache import transform_source_key

KEYS_AFTER_RMSNORM = ("fuse_rmsnorm", "fuse_rope", "insert_cached_attention", "compile_model")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _probed(wb):
    """key -> numerics of the snapshots whose probe ran (not carried over from an unchanged graph)."""
    return {s.key: s.numerics for s in wb.snapshots if s.numerics is not None and not s.numerics.carried_from}


def test_a_repeat_run_reads_the_same_numbers_and_generates_the_same_tokens(cache_dir):
    first = Workbench("tiny:llama", probe_cache=True)
    first.run()
    computed = _probed(first)
    assert len(computed) >= 10 and not any(n.from_cache for n in computed.values())
    assert len(list((cache_dir / "probes").glob("*.json"))) == len(computed)

    second = Workbench("tiny:llama", probe_cache=True)
    second.run()
    read = _probed(second)
    assert read.keys() == computed.keys() and all(n.from_cache for n in read.values())
    for key, n in computed.items():
        assert (read[key].max_abs, read[key].rmse_ratio, read[key].top1_agreement) == (
            n.max_abs, n.rmse_ratio, n.top1_agreement), key
    prompts = [[5, 6, 7], [1, 2, 3, 4]]
    assert (second.generate(prompts, max_new_tokens=8, stop_token_ids=[]).token_ids
            == first.generate(prompts, max_new_tokens=8, stop_token_ids=[]).token_ids)


def test_other_weights_or_a_changed_config_run_the_probes_again(cache_dir):
    Workbench("tiny:llama", probe_cache=True).run()
    other_weights = Workbench("tiny:llama", probe_cache=True, seed=1)
    other_weights.run()
    assert not any(n.from_cache for n in _probed(other_weights).values())

    # fuse_rmsnorm with another backend: every probe before it is read, the ones from it on run
    changed = Workbench("tiny:llama", probe_cache=True, overrides={"fuse_rmsnorm.backend": "torch"})
    changed.run()
    probed = _probed(changed)
    at = changed.index("fuse_rmsnorm")
    before = {k: n for k, n in probed.items() if changed.index(k) < at}
    after = {k: n for k, n in probed.items() if changed.index(k) >= at}
    assert before and all(n.from_cache for n in before.values())
    assert after and not any(n.from_cache for n in after.values())


def test_off_unless_asked_and_with_the_cache_dir_off(cache_dir, monkeypatch):
    Workbench("tiny:llama").run_to("match_rmsnorm_pattern")  # the Python API: off by default
    assert not (cache_dir / "probes").exists()
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", "off")
    wb = Workbench("tiny:llama", probe_cache=True)
    wb.run_to("match_rmsnorm_pattern")
    assert not any(n.from_cache for n in _probed(wb).values()) and not (cache_dir / "probes").exists()


def test_transforms_from_outside_the_workbench_key_by_their_source_or_not_at_all():
    from workbench.pipeline.interface import TRANSFORMS

    own = transform_source_key([TRANSFORMS.get("fuse_gemms")])
    assert own == transform_source_key([])  # the workbench's files are hashed once, not per class

    class Here:  # a transform defined in this file: its file joins the key
        pass

    assert transform_source_key([Here]) not in (None, own)
    made = type("Made", (), {"__module__": "nowhere"})  # no source file: nothing is reused
    assert transform_source_key([made]) is None


def test_the_graph_text_reused_between_steps_is_the_text_made_afresh(cache_dir):
    """``graph_structure``'s memo (each node formatted once per pipeline) gives, at every step, the
    text a fresh formatting gives: a node a transform rewired or retargeted is formatted again."""
    from workbench.pipeline.probe_cache import graph_structure

    wb = Workbench("tiny:llama", probe_cache=True)
    texts: dict = {}
    checked = 0
    while not wb.done:
        wb.step()
        if isinstance(wb._live, torch.fx.GraphModule):
            assert graph_structure(wb._live, texts) == graph_structure(wb._live), wb.keys[wb.position - 1]
            checked += 1
    assert checked >= 40 and texts
