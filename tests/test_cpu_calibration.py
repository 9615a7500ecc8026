"""The CPU calibration behind ``auto`` (workbench/ops/cpu_kernels/calibrate.py): the rules that turn
times into choices, the cache and its keys, and what a bad cache entry gets (measured again, never
believed)."""

from __future__ import annotations

import json

import os

import pytest
import torch

from workbench.cache_dir import sealed, unsealed
from workbench.ops.cpu_kernels import calibrate


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory, no calibration remembered in this process, and an idle machine as
    far as the contention check can tell (the suite's other workers keep the CPUs busy)."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_busy_elsewhere", lambda before, after: 0.0)
    calibrate._attention.cache_clear()
    yield tmp_path
    calibrate._attention.cache_clear()


def fake_times(monkeypatch, times):
    """Every workload "measures" ``times`` (seconds per pass, by candidate); returns the candidate
    sets timed, one list per measurement."""
    calls = []

    def best_of(fns, rounds=calibrate.ROUNDS):
        calls.append(sorted(fns))
        return {k: times[k] for k in fns}

    monkeypatch.setattr(calibrate, "_best_of", best_of)
    return calls


def weights(n=3):
    return [torch.randn(64, 32) for _ in range(n)]


def int4(n=2):
    return [(torch.zeros(64, 16, dtype=torch.uint8), torch.ones(64, 1).half(), torch.zeros(64, 1).half(), 32)] * n


def test_the_fastest_fp32_spelling_wins(fresh, monkeypatch):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    m = calibrate.fp32_linear_choice(weights())
    assert m.choice == "nk" and calls == [["kernel", "nk", "wxt"]]
    assert m.why() == ("nk (calibrated on this CPU, 3 fp32 linears, 0 MiB (others need 1.10x the kernel): "
                       "nk 1.00 ms, kernel 2.00 ms, wxt 3.00 ms)")


@pytest.mark.parametrize("speedup, expected", [(1.05, "kernel"), (1.10, "nk")])
def test_another_fp32_spelling_must_beat_the_kernel_by_a_margin(fresh, monkeypatch, speedup, expected):
    fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 2e-3 / speedup})
    assert calibrate.fp32_linear_choice(weights()).choice == expected


@pytest.mark.parametrize("speedup, expected", [(1.05, "fp32"), (1.10, "int8"), (1.5, "int8")])
def test_int8_activations_need_a_margin(fresh, monkeypatch, speedup, expected):
    """int8 activations change the numerics: 5 % faster is not enough, 10 % is."""
    fake_times(monkeypatch, {"fp32": 2e-3, "int8": 2e-3 / speedup})
    assert calibrate.int4_activation_choice(int4()).choice == expected


def test_without_kernels_only_the_torch_spellings_are_timed(fresh, monkeypatch):
    from workbench.ops import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: "switched off (WORKBENCH_CPU_ISA=none)")
    calls = fake_times(monkeypatch, {"wxt": 3e-3, "nk": 1e-3, "torch": 4e-3})
    assert calibrate.fp32_linear_choice(weights()).choice == "nk"
    m = calibrate.attention_choice()
    assert calls == [["nk", "wxt"], ["torch"]]
    assert m.choice == "torch" and m.why() == "torch (the only candidate here)"


def test_measured_once_then_read_from_the_cache(fresh, monkeypatch):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    w = weights()
    first = calibrate.fp32_linear_choice(w)
    assert not first.cached and len(calls) == 1
    (entry,) = (fresh / "calibration").iterdir()
    again = calibrate.fp32_linear_choice(w)  # as in a new process: the file answers
    assert again.cached and len(calls) == 1 and again.choice == first.choice and again.times == first.times
    assert "calibration cached for this CPU" in again.why()
    assert read_entry(entry)["times"] == first.times
    calibrate.fp32_linear_choice(weights(4))  # other shapes: another workload, measured on its own
    assert len(calls) == 2 and len(list((fresh / "calibration").iterdir())) == 2


def read_entry(path):
    """A cache entry's JSON (entries are sealed with a checksum of key and bytes: cache_dir.sealed)."""
    return json.loads(unsealed(path.stem, path.read_bytes()))


def write_entry(path, text):
    """Write ``text`` as a valid sealed entry: what the checks behind the checksum then see."""
    path.write_bytes(sealed(path.stem, text.encode()))


def test_an_edited_entry_fails_its_checksum_and_is_measured_again(fresh, monkeypatch, caplog):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    calibrate.fp32_linear_choice(weights())
    (entry,) = (fresh / "calibration").iterdir()
    entry.write_bytes(entry.read_bytes().replace(b'"nk"', b'"wxt"', 1))  # plausible JSON, not the measured one
    m = calibrate.fp32_linear_choice(weights())
    assert len(calls) == 2 and not m.cached and m.choice == "nk"
    assert "does not match its checksum" in caplog.text and entry.name in caplog.text


@pytest.mark.parametrize("edit", [
    lambda d: "not json at all",
    lambda d: json.dumps({**d, "choice": "mkl"}),  # a choice that is no candidate
    lambda d: json.dumps({**d, "choice": "wxt", "times": {"nk": 0.001}}),  # a choice no time backs
    lambda d: json.dumps({**d, "times": {**d["times"], "nk": -1.0}}),  # a negative time
    lambda d: json.dumps({**d, "kind": "attention"}),  # another kind's entry
    lambda d: json.dumps({k: v for k, v in d.items() if k != "workload"}),  # a field missing
])
def test_a_bad_cache_entry_is_measured_again_and_rewritten(fresh, monkeypatch, edit):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    w = weights()
    calibrate.fp32_linear_choice(w)
    (entry,) = (fresh / "calibration").iterdir()
    write_entry(entry, edit(read_entry(entry)))
    m = calibrate.fp32_linear_choice(w)
    assert len(calls) == 2 and not m.cached and m.choice == "nk"
    assert read_entry(entry)["choice"] == "nk"  # rewritten


def test_each_thread_count_is_calibrated_on_its_own(fresh, monkeypatch):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        calibrate.fp32_linear_choice(weights())
        torch.set_num_threads(2)
        calibrate.fp32_linear_choice(weights())
        assert len(calls) == 2 and len(list((fresh / "calibration").iterdir())) == 2
    finally:
        torch.set_num_threads(before)


def test_a_linear_choice_times_at_most_max_bytes_of_weights(fresh, monkeypatch):
    monkeypatch.setattr(calibrate, "MAX_BYTES", 2 * 64 * 32 * 4)
    fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    assert calibrate.fp32_linear_choice(weights(5)).workload.startswith("2 fp32 linears")


def test_real_calibrations_give_valid_choices_and_times(fresh):
    # measured here, not read from the user's cache; times only have to be plausible (a loaded
    # machine makes them long): what a cache entry must hold to be believed again
    from workbench.ops import cpu_kernels

    for m in (calibrate.fp32_linear_choice(weights()), calibrate.attention_choice()):
        assert m.choice in calibrate.CANDIDATES[m.kind] and m.choice in m.times
        assert all(0 < t < 60 for t in m.times.values()), m.times
        assert not m.cached
    if cpu_kernels.load() is None:
        q = torch.randint(0, 256, (256, 64), dtype=torch.uint8)
        s, o = torch.rand(256, 4).half() * 0.01, torch.zeros(256, 4).half()
        m = calibrate.int4_activation_choice([(q, s, o, 32)] * 4)
        assert m.choice in ("fp32", "int8") and set(m.times) == {"fp32", "int8"}


def test_a_measurement_taken_on_a_busy_machine_is_used_but_not_cached(fresh, monkeypatch):
    calls = fake_times(monkeypatch, {"kernel": 2e-3, "wxt": 3e-3, "nk": 1e-3})
    monkeypatch.setattr(calibrate, "_busy_elsewhere", lambda before, after: 0.6)
    w = weights()
    first = calibrate.fp32_linear_choice(w)
    assert first.choice == "nk" and first.contended == 0.6
    assert "while other processes used 60% of it (not cached)" in first.why()
    assert not (fresh / "calibration").exists() or not list((fresh / "calibration").iterdir())
    monkeypatch.setattr(calibrate, "_busy_elsewhere", lambda before, after: 0.1)
    second = calibrate.fp32_linear_choice(w)  # measured again, on a quiet machine: kept
    assert len(calls) == 2 and not second.cached and second.contended is None
    assert calibrate.fp32_linear_choice(w).cached and len(calls) == 2


def test_the_contention_meter_counts_other_processes_not_this_one(monkeypatch):
    """``_busy_elsewhere``: the machine's busy CPU time (/proc/stat) less this process's own, over the
    wall time of all CPUs; a real child spinning on one CPU is seen."""
    import subprocess
    import sys
    import time

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    # 1 s of wall on 4 CPUs: 3.0 CPU-s busy, 1.0 of it this process's -> others held half the machine
    assert calibrate._busy_elsewhere((0.0, 10.0, 5.0), (1.0, 13.0, 6.0)) == 0.5
    assert calibrate._busy_elsewhere((0.0, 10.0, 5.0), (1.0, 11.0, 6.0)) == 0.0  # only this process
    assert calibrate._busy_elsewhere((0.0, 10.0, 5.0), (0.01, 11.0, 5.0)) is None  # too short to say
    assert calibrate._busy_elsewhere(None, (1.0, 11.0, 6.0)) is None
    monkeypatch.undo()

    if calibrate._cpu_use() is None:
        pytest.skip("no /proc/stat on this system: measurements are cached as before")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.5)  # the child's start-up
        before = calibrate._cpu_use()
        time.sleep(0.6)
        other = calibrate._busy_elsewhere(before, calibrate._cpu_use())
    finally:
        spin.kill()
        spin.wait()
    assert other is not None and other >= 0.6 / (os.cpu_count() or 1), other  # one CPU kept busy
