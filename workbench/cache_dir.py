"""The workbench's on-disk cache: ``$WORKBENCH_CACHE_DIR`` (default ``~/.cache/workbench``; ``off``,
``0``, ``none`` or empty switch it off). It holds what is derived once and keyed by its inputs:
converted GGUF copies, the built C++ kernels, the ops of each traced pattern, numerics probe
results (``pipeline/probe_cache.py``), exported graphs (``pipeline/transforms/export/export_cache.py``).

The probe and export caches are keyed by the workbench's own source among other things, so every
update of the code starts new entries and the old ones are never read again. Those two directories
are ``KeyedFiles`` kept within a size (``keep_within``): the least recently used entries (written or
read: a read ``touch``es its file) go first, once per cache object, which is once per run."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Set, Tuple

_VAR = "WORKBENCH_CACHE_DIR"
logger = logging.getLogger("workbench.cache")
_said: Set[str] = set()  # notices already given in this process: one line each, not one per cache object


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
    value = os.environ.get(_VAR)
    if value is not None and value and not value.strip():
        return None, f"{_VAR} is set to blanks ({value!r}): the cache is off; set it to a directory (or to off)"
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


def say_once(text: str) -> None:
    """Log a cache notice once per process (every cache object of a run would repeat it)."""
    if text not in _said:
        _said.add(text)
        logger.warning("workbench cache: %s", text)


def untrusted(path: Path, top: Optional[Path] = None) -> Optional[str]:
    """Why code must not be loaded from ``path`` (a pickle, a shared library), or None: ``path`` and
    every directory above it up to ``top`` (default: the cache root) must belong to this user (or
    root) and be writable by nobody else -- as ssh refuses a group-writable ``~/.ssh``. Anyone who
    can write there could otherwise run code in the next run. Directories not yet made are fine."""
    if not hasattr(os, "getuid"):
        return None  # no POSIX ownership to check
    top = top or cache_root()
    chain = [path, *path.parents]
    if top is not None and top in chain:
        chain = chain[: chain.index(top) + 1]
    for d in chain:
        try:
            st = d.stat()
        except OSError:
            continue
        if st.st_uid not in (os.getuid(), 0):
            return f"{d} belongs to another user (uid {st.st_uid}): use a cache directory of your own ({_VAR})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return (
                f"{d} is writable by {'everyone' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):o}), so another user could put code there: chmod go-w {d}"
            )
    return None


_MAGIC = b"workbench-cache-entry sha256="


def sealed(key: str, data: bytes) -> bytes:
    """``data`` with a first line carrying the sha256 of its key and bytes (``unsealed`` checks it)."""
    return _MAGIC + hashlib.sha256(key.encode() + b"\0" + data).hexdigest().encode() + b"\n" + data


def unsealed(key: str, blob: bytes) -> Optional[bytes]:
    """The data of a ``sealed`` entry, or None when its checksum does not match (edited, damaged,
    another key's entry copied over, or written before entries were sealed)."""
    head, sep, data = blob.partition(b"\n")
    if not sep or not head.startswith(_MAGIC):
        return None
    want = hashlib.sha256(key.encode() + b"\0" + data).hexdigest().encode()
    return data if head[len(_MAGIC) :] == want else None


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


class KeyedFiles:
    """``$WORKBENCH_CACHE_DIR/<subdir>/<key><suffix>``: one entry per file, written atomically and
    sealed with a checksum of its key and bytes (``sealed``), the directory kept within ``max_bytes``
    (``keep_within``, at the first write of this object: one scan per run). ``dir`` is None when
    the cache is switched off or cannot be used (said once, with why). ``trusted``: why the entries
    may come only from a directory nobody else can write (what they decide: code that is loaded, a
    graph the model runs), so the directory must also pass ``untrusted``; None for entries that are
    only numbers."""

    def __init__(self, subdir: str, suffix: str, max_bytes: int, trusted: Optional[str] = None) -> None:
        root, why = usable_cache_root()
        self.dir = root / subdir if root is not None else None
        if why is None and self.dir is not None and trusted is not None:
            why = untrusted(self.dir)
            if why is not None:
                why = f"not reading or writing {subdir} entries ({trusted}): {why}"
                self.dir = None
        if why is not None:
            say_once(why)
        self.suffix, self.max_bytes = suffix, max_bytes
        self._kept_within = False

    def read(self, key: str) -> Optional[bytes]:
        """The entry's bytes, or None (absent, unreadable, failing its checksum, or the cache off).
        A caller that finds them valid marks the entry ``used``."""
        if self.dir is None:
            return None
        path = self.dir / f"{key}{self.suffix}"
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        data = unsealed(key, blob)
        if data is None and blob.startswith(_MAGIC):
            say_once(f"{path} does not match its checksum (edited or damaged): ignored, recomputed")
        elif data is None:  # written before entries were sealed: replaced by the next write, quietly
            logger.info("%s predates sealed cache entries: recomputed", path)
        return data

    def used(self, key: str) -> None:
        if self.dir is not None:
            touch(self.dir / f"{key}{self.suffix}")

    def write(self, key: str, data: bytes) -> Optional[str]:
        """Write the entry; returns why not when it cannot be (a read-only cache only costs the work)."""
        if self.dir is None:
            return "the cache is off"
        try:
            write_atomically(self.dir / f"{key}{self.suffix}", sealed(key, data))
        except OSError as e:
            say_once(f"cannot write to {self.dir} ({e}): every run repeats the work it would keep")
            return f"not written: {e}"
        if not self._kept_within:
            self._kept_within = True
            keep_within(self.dir, self.max_bytes, self.suffix)
        return None


def touch(path: Path) -> None:
    """Mark ``path`` as just used (its mtime), for ``keep_within``; a read-only cache stays as it is."""
    try:
        os.utime(path)
    except OSError:
        pass


def _entries(directory: Path, suffix: str) -> Iterator[Tuple[float, int, Path]]:
    """(mtime, bytes on disk, path) of each ``*suffix`` file; files that vanish meanwhile are skipped."""
    try:
        scan = list(os.scandir(directory))
    except OSError:
        return
    for entry in scan:
        if not entry.name.endswith(suffix):
            continue
        try:
            st = entry.stat()
        except OSError:
            continue
        yield st.st_mtime, st.st_blocks * 512, Path(entry.path)


def keep_within(directory: Optional[Path], max_bytes: int, suffix: str) -> int:
    """Remove the least recently used ``*suffix`` files of ``directory`` (oldest mtime first) until
    the rest take at most ``max_bytes`` of disk; returns how many went. Another process sharing the
    cache may remove the same files or read one being removed: a missing entry is recomputed."""
    if directory is None:
        return 0
    entries = sorted(_entries(directory, suffix))
    total = sum(size for _, size, _ in entries)
    removed = 0
    for _, size, path in entries:
        if total <= max_bytes:
            break
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
        total -= size
    return removed
