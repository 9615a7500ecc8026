"""What ``workbench run`` does about ``--report`` and ``--debug-visualize-dir`` (the CLI's side of
``outputs``): check both directories before the model loads, write the report(s) so that a failure is
a line instead of a traceback, and print the failures after the answer.

The answer is what the user waited minutes for; a report is a by-product. So a report or render
that fails after the pipeline never stops the run: the answer is printed, then one ``error:`` line
per failed output, and the exit code is 1 (the user asked for that output and did not get it).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, List, Optional

from ..output_dirs import LOW_FREE_BYTES, MIN_FREE_BYTES, ensure_writable_dir
from .outputs import dot_available, failure_line, mark_given, report_notice, warn_once


def check_outputs(report: Optional[str], renders: Optional[str], rank: int = 0) -> None:
    """Refuse an unwritable or full ``--report`` / ``--debug-visualize-dir`` (``InputError``: one
    line, exit 1) and say what a missing ``dot`` changes for the report, before minutes of pipeline.
    How renders are written without ``dot`` is said by ``Workbench`` (it is true of the API too)."""
    for path, flag in ((report, "--report"), (renders, "--debug-visualize-dir")):
        if path:
            ensure_writable_dir(path, flag, min_free=MIN_FREE_BYTES, low_free=LOW_FREE_BYTES)
    if report and not dot_available():
        if rank == 0:
            warn_once("report-no-dot", report_notice("--report"))
        else:  # a torchrun rank > 0: rank 0 said it for all
            mark_given("report-no-dot")


def report_dir(out_dir: str, rank: int) -> str:
    """Rank 0 writes where the user said; other ranks (their graphs differ once sharded) in ``rank<r>/``."""
    return out_dir if rank == 0 else os.path.join(out_dir, f"rank{rank}")


def write_reports(
    wb: Any, out_dir: str, ranks: Iterable[int], say: Callable[[str], None], *, sharded: bool
) -> List[str]:
    """Write the HTML report of each of ``ranks`` (a ``ShardedWorkbench`` has each rank write its
    own; a one-process ``Workbench`` writes its own), saying where; returns the failures as lines."""
    failures = []
    for r in ranks:
        where = report_dir(out_dir, r)
        try:
            if sharded:
                path = wb.report(where, rank=r, warn_no_dot=False)
            else:
                from .report import write_report  # looked up now: tests replace it

                path = write_report(wb, where, warn_no_dot=False)  # the notice was said up front
        except Exception as e:  # noqa: BLE001 - any failure: one line after the answer, exit 1
            failures.append(failure_line("--report", where, e))
        else:
            say(f"report: {path}")
    return failures


def render_failures(wb: Any, flag: str, out_dir: Optional[str]) -> List[str]:
    """The renders that failed (``Workbench.render_failures``; the pipeline went on), as one line.
    A ``ShardedWorkbench``'s ranks keep theirs and warn in their own output."""
    failed = getattr(wb, "render_failures", None)
    if not failed:
        return []
    first = failed[0]
    return [
        f"{flag} {out_dir!r}: {len(failed)} render(s) failed, the first #{first.index:02d} {first.key} "
        f"({first.error}); {first.fix}"
    ]


def say_failures(failures: List[str]) -> None:
    """One ``error:`` line per failed output, on stderr, after everything printed so far."""
    sys.stdout.flush()  # the answer first, also when both streams go to one file
    for line in failures:
        print(f"error: {line}", file=sys.stderr, flush=True)
