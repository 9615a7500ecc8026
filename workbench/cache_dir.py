"""The workbench's on-disk cache: ``$WORKBENCH_CACHE_DIR`` (default ``~/.cache/workbench``; ``off``,
``0``, ``none`` or empty switch it off). It holds what is derived once and keyed by its inputs:
converted GGUF copies, the built C++ kernels, the anchor op of each traced pattern."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def cache_root() -> Optional[Path]:
    """The cache directory, or None when the cache is switched off."""
    root = os.environ.get("WORKBENCH_CACHE_DIR", str(Path.home() / ".cache" / "workbench"))
    if root.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(root)
