"""The CPU calibration behind ``auto`` (workbench/ops/cpu_kernels/calibrate.py): the rules that turn
times into choices, the cache, and what a bad cache entry gets (measured again, never believed)."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.ops.cpu_kernels import calibrate


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no calibration remembered in this process."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    calibrate._calibration.cache_clear()
    yield tmp_path
    calibrate._calibration.cache_clear()


def fake_times(monkeypatch, times):
    """Every workload "measures" ``times`` (seconds per pass, by candidate) and counts the calls."""
    calls = []

    def best_of(fns, rounds=calibrate.ROUNDS):
        calls.append(sorted(fns))
        return {k: times[k] for k in fns}

    monkeypatch.setattr(calibrate, "_best_of", best_of)
    return calls


TIMES = {"fp32 kernel": 2e-3, "fp32 wxt": 3e-3, "fp32 nk": 1e-3, "int4 fp32": 2e-3, "int4 int8": 1.5e-3,
         "attention cpu": 1e-4, "attention torch": 4e-3}  # fmt: skip


def test_the_fastest_candidate_wins_and_int8_needs_a_margin(monkeypatch):
    fake_times(monkeypatch, TIMES)
    cal = calibrate.measure(kernels=True)
    assert (cal.fp32_linear, cal.int4_activations, cal.attention) == ("nk", "int8", "cpu")
    assert cal.why("fp32_linear") == "nk (calibrated on this CPU: nk 1.00 ms, kernel 2.00 ms, wxt 3.00 ms)"
    # int8 activations change the numerics: 5 % faster is not enough, 10 % is
    fake_times(monkeypatch, {**TIMES, "int4 int8": 2e-3 / 1.05})
    assert calibrate.measure(kernels=True).int4_activations == "fp32"
    fake_times(monkeypatch, {**TIMES, "int4 int8": 2e-3 / 1.10})
    assert calibrate.measure(kernels=True).int4_activations == "int8"


def test_without_kernels_only_the_torch_spellings_are_timed(monkeypatch):
    calls = fake_times(monkeypatch, TIMES)
    cal = calibrate.measure(kernels=False)
    assert calls == [["fp32 nk", "fp32 wxt"], ["attention torch"]]
    assert (cal.fp32_linear, cal.int4_activations, cal.attention) == ("nk", "fp32", "torch")
    assert cal.why("attention") == "torch (the only candidate here)"


def test_measured_once_then_read_from_the_cache(fresh, monkeypatch):
    calls = fake_times(monkeypatch, TIMES)
    first = calibrate.calibration()
    assert not first.cached and calls
    (entry,) = (fresh / "calibration").iterdir()
    calibrate._calibration.cache_clear()  # a new process: the file answers
    calls.clear()
    again = calibrate.calibration()
    assert again.cached and not calls
    assert (again.fp32_linear, again.int4_activations, again.attention) == (first.fp32_linear, first.int4_activations,
                                                                            first.attention)
    assert "calibration cached for this CPU" in again.why("fp32_linear")
    assert json.loads(entry.read_text())["times"] == first.times


@pytest.mark.parametrize("edit", [
    lambda d: "not json at all",
    lambda d: json.dumps({**d, "fp32_linear": "mkl"}),  # a choice that is no candidate
    lambda d: json.dumps({**d, "attention": "torch", "times": {"fp32 nk": 0.001}}),  # a choice no time backs
    lambda d: json.dumps({**d, "times": {**d["times"], "fp32 nk": -1.0}}),  # a negative time
    lambda d: json.dumps({k: v for k, v in d.items() if k != "int4_activations"}),  # a field missing
])
def test_a_bad_cache_entry_is_measured_again_and_rewritten(fresh, monkeypatch, edit):
    calls = fake_times(monkeypatch, TIMES)
    calibrate.calibration()
    (entry,) = (fresh / "calibration").iterdir()
    entry.write_text(edit(json.loads(entry.read_text())))
    calibrate._calibration.cache_clear()
    calls.clear()
    cal = calibrate.calibration()
    assert calls and not cal.cached and cal.fp32_linear == "nk"
    assert json.loads(entry.read_text())["fp32_linear"] == "nk"  # rewritten


def test_each_thread_count_is_calibrated_on_its_own(fresh, monkeypatch):
    calls = fake_times(monkeypatch, TIMES)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        calibrate.calibration()
        n = len(calls)
        torch.set_num_threads(2)
        calibrate.calibration()
        assert len(calls) == 2 * n and len(list((fresh / "calibration").iterdir())) == 2
    finally:
        torch.set_num_threads(before)


def test_a_real_calibration_gives_valid_choices_and_times():
    cal = calibrate.calibration()
    assert cal.fp32_linear in calibrate.FP32_CHOICES and cal.attention in calibrate.ATTENTION_CHOICES
    assert cal.int4_activations in calibrate.ACT_CHOICES
    assert all(0 < t < 1 for t in cal.times.values()), cal.times
