"""The files a run writes besides its answer (renders, the HTML report) must never cost the answer.

A GPU machine often has no graphviz ``dot`` binary, and a report directory can be unwritable or
full; finding that out after minutes of pipeline used to end the run with a traceback and nothing
generated. This module holds what the CLI and ``Workbench`` share to avoid that:

* ``dot_available`` and the notices for what a missing ``dot`` changes (renders become ``.dot``
  sources; the report leaves its graph pictures out), said once, before the pipeline starts;
* ``write_snapshot_render``: the ``debug_visualize_dir`` writer (SVG, or the source without ``dot``);
* ``failure_line`` / ``explain_failure``: a failure of one of these outputs as one line that names
  it and the fix, not a traceback.
"""

from __future__ import annotations

import errno
import logging
import shutil
import traceback
from pathlib import Path
from typing import Set, Tuple, Union

from ..pipeline.snapshot import Snapshot
from .render import DotMissingError, snapshot_digraph, snapshot_svg_name, to_svg

logger = logging.getLogger("workbench")

DOT_FIX = "install the Debian package graphviz (`apt-get install graphviz`, or `make system-deps`)"

_GIVEN: Set[str] = set()  # notices already said in this process


def dot_available() -> bool:
    """Whether graphviz's ``dot`` is on PATH: the graphviz package runs it by that name."""
    return shutil.which("dot") is not None


def warn_once(key: str, message: str) -> None:
    """Log ``message`` unless a notice with ``key`` was already given in this process (the CLI says
    it up front; the writers would otherwise say it again)."""
    if key not in _GIVEN:
        _GIVEN.add(key)
        logger.warning(message)


def mark_given(key: str) -> None:
    """Treat ``key``'s notice as said (a torchrun rank > 0: rank 0 says it for everyone)."""
    _GIVEN.add(key)


def report_notice(what: str = "report") -> str:
    """Said once, before the pipeline when the CLI writes the report."""
    return (
        f"{what}: the graphviz 'dot' binary is missing, so the report is written without its graph "
        f"pictures (tables, numbers and chart only; each graph's Graphviz source under dot/); "
        f"{DOT_FIX} to get them"
    )


def report_notice_html() -> str:
    """The same, at the top of the report itself: whoever opens it later knows why it has no pictures."""
    return (
        "No graph pictures: there was no graphviz 'dot' binary where this report was written. The tables, "
        "numbers and chart are complete; each graph's Graphviz source is under dot/ (draw one with "
        f"`dot -Tsvg FILE -O`). To get the pictures, {DOT_FIX} and run again."
    )


def renders_notice(out_dir: Union[str, Path], what: str = "debug_visualize_dir") -> str:
    return (
        f"{what}: the graphviz 'dot' binary is missing, so each snapshot is written as its Graphviz "
        f"source {Path(out_dir) / 'NN_<transform>.dot'} instead of an SVG (render one later with "
        f"`dot -Tsvg FILE -O`); {DOT_FIX} to get SVGs"
    )


def source_name(snap: Snapshot) -> str:
    return snapshot_svg_name(snap)[: -len(".svg")] + ".dot"


def write_snapshot_render(snap: Snapshot, out_dir: Union[str, Path]) -> Path:
    """Write ``out_dir/NN_<key>.svg``, or ``NN_<key>.dot`` (the Graphviz source) without ``dot``:
    a missing binary costs the picture, not the render."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    digraph = snapshot_digraph(snap)
    if dot_available():
        try:
            svg = to_svg(digraph)
        except DotMissingError:  # gone since it was looked up: fall through to the source
            pass
        else:
            path = out / snapshot_svg_name(snap)
            path.write_text(svg, encoding="utf-8")
            return path
    path = out / source_name(snap)
    path.write_text(digraph.source, encoding="utf-8")
    return path


def explain_failure(exc: BaseException, what: str) -> Tuple[str, str]:
    """(what happened, what to do) for ``exc``, raised writing ``what`` (a flag or option name).

    Disk full and permissions are the user's to fix; anything else is a bug of ours, so the advice
    says where it was raised instead of printing a traceback."""
    text = str(exc).strip().splitlines()  # a rank's error carries its traceback: keep the first line
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    err = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and err in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return detail, "free some space on that disk or pick a directory on another one"
    if isinstance(exc, OSError) and err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return detail, "make it writable or pick another directory"
    if isinstance(exc, OSError):
        return detail, "check that directory (space, permissions) or pick another one"
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    at = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return detail, f"a bug in workbench{at}: please report it, and leave {what} out until it is fixed"


def failure_line(what: str, target: Union[str, Path], exc: BaseException) -> str:
    """``exc``, raised writing ``what`` into ``target``, as one line: what failed and what to do."""
    detail, fix = explain_failure(exc, what)
    return f"{what} {str(target)!r} failed ({detail}); {fix}"


__all__ = [
    "DOT_FIX",
    "dot_available",
    "explain_failure",
    "failure_line",
    "mark_given",
    "renders_notice",
    "report_notice",
    "report_notice_html",
    "source_name",
    "warn_once",
    "write_snapshot_render",
]
