"""Directories the workbench writes into (renders, reports, check results): checked before any
work is spent on filling them, so a bad path or a full disk is one line up front, not a traceback
after minutes of pipeline."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Union

from .errors import InputError

logger = logging.getLogger("workbench")

# Free space for renders and reports: below the first a directory is refused (nothing useful fits:
# tiny:llama's report is ~8 MiB, its renders ~11 MiB; a real model's are larger), below the second a
# warning says they may not fit.
MIN_FREE_BYTES = 1 << 20
LOW_FREE_BYTES = 64 << 20


def ensure_writable_dir(path: Union[str, Path], what: str, *, min_free: int = 0, low_free: int = 0) -> Path:
    """Create ``path`` if needed and check it takes files, before any work is spent on writing there.

    An empty probe file still fits on a full disk, so with ``min_free`` the free space is checked
    too (refused below ``min_free`` bytes, a warning below ``low_free``): a report that cannot fit
    should be said before the pipeline, not after it."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".workbench-write-check"
        probe.write_text("")
        probe.unlink()
        free = shutil.disk_usage(p).free if min_free or low_free else None
    except OSError as e:
        raise InputError(
            f"{what} {str(p)!r} cannot be written ({type(e).__name__}: {e.strerror or e}); "
            "pick a directory you can write to"
        ) from None
    if free is not None and free < min_free:
        raise InputError(
            f"{what} {str(p)!r} is on a full disk ({free / 2**20:.1f} MiB free); "
            "free some space or pick a directory on another disk"
        )
    if free is not None and free < low_free:
        logger.warning(
            "%s %r: only %.0f MiB free on its disk, and renders and reports take tens of MiB "
            "for a real model: they may not fit (free some space or pick another directory)",
            what,
            str(p),
            free / 2**20,
        )
    return p


__all__ = ["ensure_writable_dir", "MIN_FREE_BYTES", "LOW_FREE_BYTES"]
