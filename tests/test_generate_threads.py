"""``generate`` on one Workbench from several threads at once gives each caller the tokens it gets alone.

Every ``generate`` call schedules its prompts on a fresh ``Scheduler`` whose page allocator hands out
pages lowest id first, and all calls share the Workbench's one set of cache tensors (and, once
``compile_model`` built one, one runner with fixed-address step buffers). Two unserialised calls
therefore write their K/V into the same pages and read each other's. The Workbench serialises
everything that drives its runner and caches (``generate``, ``answer``, the pipeline's steps).

The interpreter's switch interval is lowered while the threads run so that they interleave every
few bytecodes, not every 5 ms: without the lock nearly every trial mixes the two calls' steps.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, List, Optional

import pytest

from workbench import Workbench

ONE_THREAD = True  # see conftest.one_thread
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
NEW = 16
TRIALS = 6


def _gen(wb: Workbench, prompt: List[int]) -> List[int]:
    return wb.generate([prompt], max_new_tokens=NEW, stop_token_ids=[]).token_ids[0]


def _together(*calls: Callable[[], object]) -> List[object]:
    """Run ``calls`` in one thread each, started together at a barrier; their results (or errors)."""
    barrier = threading.Barrier(len(calls))
    out: List[Optional[object]] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - reported by the assertion, with the other thread's result
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s (deadlock?)"
    return list(out)


@pytest.fixture(scope="module")
def wb():
    bench = Workbench("tiny:llama", device="cpu", numerics=False)
    bench.run()
    return bench


@pytest.fixture(scope="module")
def reference(wb):
    """Each prompt generated alone; batched together they give the same tokens (checked here too)."""
    alone = [_gen(wb, p) for p in PROMPTS]
    batched = wb.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).token_ids
    assert batched == alone
    return alone


def test_two_threads_generate_the_tokens_each_gets_alone(wb, reference):
    wrong = []
    for trial in range(TRIALS):
        got = _together(*(lambda p=p: _gen(wb, p) for p in PROMPTS))
        if got != reference:
            wrong.append((trial, got))
    assert not wrong, f"{len(wrong)} of {TRIALS} trials differ from {reference}: {wrong}"


def test_answer_and_generate_together(wb, reference, capsys):
    """``answer`` drives the same runner: it waits for a ``generate`` running in another thread."""
    got = _together(
        lambda: wb.answer(PROMPTS[0], max_new_tokens=NEW, stop_token_ids=[]).token_ids[0], lambda: _gen(wb, PROMPTS[1])
    )
    assert got == reference


def test_generate_waits_for_the_pipeline_another_thread_runs(wb, reference):
    """A Workbench whose pipeline a second thread is still running (a panel's background run and a
    notebook cell): generate waits for the run instead of using half-built caches."""
    fresh = wb.with_options()
    got = _together(fresh.run, lambda: _gen(fresh, PROMPTS[0]), lambda: _gen(fresh, PROMPTS[1]))
    assert not any(isinstance(g, BaseException) for g in got), got
    assert fresh.done
    assert got[1:] == reference


def test_each_workbench_has_its_own_lock(wb):
    """No state shared between Workbenches: re-running the cell that builds one gets a new lock."""
    other = wb.with_options()
    assert other.runtime_lock is not wb.runtime_lock
