"""The workbench's on-disk cache: ``$WORKBENCH_CACHE_DIR`` (default ``~/.cache/workbench``; ``off``,
``0``, ``none`` or empty switch it off). It holds what is derived once and keyed by its inputs:
converted GGUF copies, the built C++ kernels, the ops of each traced pattern, numerics probe
results (``pipeline/probe_cache.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Tuple

_VAR = "WORKBENCH_CACHE_DIR"


def cache_root() -> Optional[Path]:
    """The cache directory, or None when the cache is switched off."""
    root = os.environ.get(_VAR, str(Path.home() / ".cache" / "workbench"))
    if root.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(root)


def usable_cache_root() -> Tuple[Optional[Path], Optional[str]]:
    """``(root, None)`` when the cache directory exists or can be created and written, ``(None, None)``
    when the cache is switched off, ``(None, reason)`` when it is set to something unusable. The reason
    names the variable, the path and the remedy, for users whose output would otherwise be a bare
    ``NotADirectoryError`` from deep inside a build. Nothing is created here: a check must not litter."""
    root = cache_root()
    if root is None:
        return None, None
    where = f"{_VAR}={root}" if _VAR in os.environ else f"the default cache directory {root} ({_VAR} is unset)"
    remedy = f"point {_VAR} at a writable directory or set it to off"
    if root.exists() and not root.is_dir():
        return None, f"{where} is a file, not a directory: {remedy}"
    nearest = root
    while not nearest.exists() and nearest != nearest.parent:  # the directory it would be created in
        nearest = nearest.parent
    if not nearest.is_dir():
        return None, f"{where} cannot be created because {nearest} is a file: {remedy}"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return None, f"{where} is not writable (no write permission on {nearest}): {remedy}"
    return root, None


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename, so a concurrent
    reader (another process sharing the cache) sees the whole file or none. Raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
