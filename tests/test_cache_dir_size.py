"""The probe and export caches stay within a size (``cache_dir.keep_within``): their keys hold the
workbench's source, so every code update starts new entries; the least recently used go first, a
read counting as a use, and a run scans its directory once."""

import os

import pytest

from workbench.cache_dir import keep_within, touch
from workbench.pipeline.numerics import Numerics
from workbench.pipeline.probe_cache import ProbeCache
from workbench.pipeline.transforms.export.export_cache import ExportCache


def _files(directory, names, size=5000, start=1_000_000):
    """``names`` written in order, each ``size`` bytes, with mtimes a minute apart (oldest first)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        path = directory / name
        path.write_bytes(b"x" * size)
        os.utime(path, (start + 60 * i, start + 60 * i))


def _disk(path):
    return path.stat().st_blocks * 512


def test_the_least_recently_used_go_until_the_rest_fit(tmp_path):
    _files(tmp_path, [f"{i}.pkl" for i in range(5)] + ["other.tmp"])
    each = _disk(tmp_path / "0.pkl")
    touch(tmp_path / "1.pkl")  # read just now: the most recently used
    assert keep_within(tmp_path, 3 * each, ".pkl") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.pkl", "3.pkl", "4.pkl", "other.tmp"]
    assert keep_within(tmp_path, 3 * each, ".pkl") == 0  # within the size: nothing goes
    assert keep_within(None, 0, ".pkl") == 0 and keep_within(tmp_path / "absent", 0, ".pkl") == 0


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_probe_cache_keeps_within_its_size_once_per_run(cache_root, monkeypatch):
    probes = cache_root / "probes"
    _files(probes, [f"old{i}.json" for i in range(4)], size=100)
    each = _disk(probes / "old0.json")
    monkeypatch.setattr(ProbeCache, "MAX_BYTES", 3 * each)
    cache = ProbeCache()
    assert cache.get("old1") is None  # not a result: unreadable, and not touched
    numerics = Numerics(max_abs=0.5, rmse_ratio=0.01, top1_agreement=1.0)
    cache.put("new0", numerics)  # 5 files: the two oldest go
    assert sorted(p.name for p in probes.iterdir()) == ["new0.json", "old2.json", "old3.json"]
    cache.put("new1", numerics)  # the same run: no second scan
    assert len(list(probes.iterdir())) == 4
    os.utime(probes / "new0.json", (1_500_000, 1_500_000))  # new0 written before new1
    os.utime(probes / "new1.json", (2_000_000, 2_000_000))
    monkeypatch.setattr(ProbeCache, "MAX_BYTES", 2 * each)
    second_run = ProbeCache()
    assert second_run.get("new0").max_abs == 0.5  # read: now the most recently used
    second_run.put("new2", numerics)
    assert sorted(p.name for p in probes.iterdir()) == ["new0.json", "new2.json"]


def test_the_export_cache_keeps_within_its_size(cache_root, monkeypatch):
    exports = cache_root / "exports"
    _files(exports, ["a.json", "b.json", "c.json"])
    each = _disk(exports / "a.json")
    monkeypatch.setattr(ExportCache, "MAX_BYTES", 2 * each)
    cache = ExportCache()
    assert cache.put("d", b"y" * 5000) is None
    assert sorted(p.name for p in exports.iterdir()) == ["c.json", "d.json"]
