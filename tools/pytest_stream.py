"""pytest plugin for ``make gpu-check``: every test's verdict is on disk the moment it finishes.

    PYTHONPATH=tools python -m pytest -p pytest_stream --stream-log OUT/tests.log \\
        --stream-failures OUT/failures.txt ...

pytest's own ``-q`` output names failures only in its final summary, and a run stopped by a time
limit never gets there. This plugin runs in the controller (with pytest-xdist the workers'
reports reach it as they finish) and appends, flushing each line:

``tests.log``, tab-separated ``<kind>\\t<seconds>\\t<node id>\\t<note>``:
    ``collected``   once per selected test, when collection ends (what "unfinished" is measured against)
    ``started``     when a test begins (so a run stopped mid-test names the tests it was running)
    ``passed`` ``failed`` ``error`` ``skipped`` ``xfailed`` ``xpassed`` ``crashed``: one line per
    finished test with its seconds (setup + call + teardown) and a note: the skip reason, or the
    first line of the failure. ``error`` is a failed setup/teardown; ``crashed`` a worker that died
    (pytest-timeout's thread method ends a hung test's worker this way; gpu_check also sets
    faulthandler_timeout, whose stack dump reaches the step's log).
``failures.txt``: each failing report's traceback, as it arrives.

xdist workers get a parent-death signal (Linux): if the controller is killed, so are they,
instead of running their current test to its end as orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

RESULTS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "crashed")


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: orphans then finish their test on their own
        pass


def pytest_addoption(parser):
    group = parser.getgroup("stream", "per-test lines written as tests finish (tools/pytest_stream.py)")
    group.addoption("--stream-log", default=None, help="append one line per collected/started/finished test")
    group.addoption("--stream-failures", default=None, help="append each failure's traceback")


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes the files
        die_with_parent()
        if os.getppid() == 1:  # the controller died before the prctl call
            os._exit(1)
        return
    log, failures = config.getoption("stream_log"), config.getoption("stream_failures")
    if log or failures:
        config.pluginmanager.register(Stream(config, log, failures), "gpu_check_stream")


def _clean(text: str) -> str:
    return " ".join(str(text).split())[:300]


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        return _clean(report.longrepr[2]).removeprefix("Skipped: ")
    return _clean(getattr(report, "wasxfail", "") or report.longreprtext)


def _failure_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _clean(crash.message.splitlines()[0] if crash.message else "")
    text = report.longreprtext.strip().splitlines()
    return _clean(text[-1] if text else "")


def verdict(reports) -> tuple:
    """(result, note) of one test from its setup/call/teardown reports."""
    by = {r.when: r for r in reports}
    setup, call, teardown = by.get("setup"), by.get("call"), by.get("teardown")
    if setup is not None and setup.failed:
        return "error", "setup: " + _failure_line(setup)
    if setup is not None and setup.skipped:
        return ("xfailed" if hasattr(setup, "wasxfail") else "skipped"), _skip_reason(setup)
    if call is not None:
        if call.failed:
            return "failed", _failure_line(call)
        if call.skipped:
            return ("xfailed" if hasattr(call, "wasxfail") else "skipped"), _skip_reason(call)
        if hasattr(call, "wasxfail"):
            return "xpassed", _clean(call.wasxfail)
    if teardown is not None and teardown.failed:
        return "error", "teardown: " + _failure_line(teardown)
    return "passed", ""


class Stream:
    def __init__(self, config, log, failures):
        self.config = config
        # append: gpu_check truncates the files once per run; line-buffered and flushed per write
        self.log = open(log, "a", buffering=1) if log else None
        self.failures = open(failures, "a", buffering=1) if failures else None
        self.reports = {}
        self.started = {}  # node id -> when it started: a crashed worker reports no duration
        self.collected = False

    def timeout(self) -> float:
        try:  # pytest-timeout's option, when that plugin is loaded
            return float(self.config.getoption("timeout") or 0)
        except (AttributeError, ValueError):
            return 0.0

    def _line(self, kind: str, seconds, nodeid: str, note: str = "") -> None:
        if self.log is not None:
            secs = f"{seconds:.2f}" if isinstance(seconds, float) else ""
            self.log.write(f"{kind}\t{secs}\t{nodeid}\t{note}\n")
            self.log.flush()

    def _collection(self, nodeids) -> None:
        if self.collected:  # with xdist every worker reports the same collection: keep the first
            return
        self.collected = True
        for nodeid in nodeids:
            self._line("collected", None, nodeid)

    def pytest_collection_finish(self, session):  # without xdist
        self._collection([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):  # with xdist (the controller collects nothing)
        self._collection(ids)

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = time.monotonic()
        self._line("started", None, nodeid)

    def pytest_runtest_logreport(self, report):
        if report.failed and self.failures is not None:
            worker = getattr(getattr(report, "node", None), "gateway", None)
            where = f" [{worker.id}]" if worker is not None else ""
            self.failures.write(f"===== {report.nodeid} ({report.when}){where}\n{report.longreprtext}\n\n")
            self.failures.flush()
        if report.when == "???":  # xdist: the worker died while running this test
            self.reports.pop(report.nodeid, None)
            secs = time.monotonic() - self.started.pop(report.nodeid, time.monotonic())
            note = _failure_line(report)
            timeout = self.timeout()
            if timeout and secs >= 0.9 * timeout:  # timed here, from the worker's report of its start
                note += f" (after {secs:.0f} s: the per-test timeout of {timeout:g} s; stacks in the step's log)"
            self._line("crashed", secs, report.nodeid, note)
            return
        self.reports.setdefault(report.nodeid, []).append(report)
        if report.when == "teardown":  # the last phase: the test has finished
            reports = self.reports.pop(report.nodeid)
            self.started.pop(report.nodeid, None)
            result, note = verdict(reports)
            self._line(result, float(sum(r.duration for r in reports)), report.nodeid, note)
