"""Building the C++ libraries once per machine and caching them on disk.

Two libraries, each a ``torch.utils.cpp_extension.load`` (g++ and ninja; the Makefile installs both)
into ``$WORKBENCH_CACHE_DIR/kernels/<prefix>-<hash of every build input>``: the kernels, one build
per ISA variant (``isa.py``), and the step program, which uses no SIMD and builds on any CPU with a
C++ compiler. 20-80 s the first time on 2 cores, then a load of the cached ``.so``; each build is
logged with its directory and duration.

The hash covers what ninja compares, not only what the library computes: ``build.ninja`` holds
absolute paths (this checkout's sources, torch's headers and libraries, the compiler), and ninja
rebuilds when a command line changes, so two checkouts or venvs sharing one directory would rebuild
each other's library on every alternate run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ...cache_dir import cache_root, untrusted, usable_cache_root

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("workbench")


@dataclass(frozen=True)
class Library:
    """One shared library: its name, the ``.cpp`` files compiled into it, the headers they include
    (hashed, not compiled), its compiler flags and the prefix of its build directory."""

    name: str
    sources: Tuple[str, ...]
    headers: Tuple[str, ...]
    flags: Tuple[str, ...]
    prefix: str
    ldflags: Tuple[str, ...] = ()

    def files(self) -> Tuple[str, ...]:
        return self.sources + self.headers


def _compiler_identity() -> List[str]:
    """The compiler torch will call, resolved through PATH and symlinks (``c++`` ->
    ``/usr/bin/x86_64-linux-gnu-g++-12``), with its size and mtime: an upgrade or a different
    ``$CXX`` gives another build, at the cost of a stat instead of running ``c++ --version``."""
    from torch.utils import cpp_extension

    name = cpp_extension.get_cxx_compiler()
    found = shutil.which(name)
    if found is None:
        return [name]
    real = os.path.realpath(found)
    st = os.stat(real)
    return [name, real, str(st.st_size), str(st.st_mtime_ns)]


def build_inputs(lib: Library, here: Path) -> List[bytes]:
    """Everything the built library and its ``build.ninja`` depend on: the sources' contents and
    absolute paths, the flags, torch's version, headers and libraries, the Python that loads it (a
    venv's prefix and executable) and the compiler."""
    from torch.utils import cpp_extension

    parts = [str(here / name).encode() + b"\0" + (here / name).read_bytes() for name in lib.files()]
    text = [
        *lib.flags,
        *lib.ldflags,
        lib.name,
        torch.__version__,
        str(torch.version.git_version),
        sys.version,
        sys.prefix,
        sys.executable,
        *cpp_extension.include_paths(),
        cpp_extension.TORCH_LIB_PATH,
        str(sysconfig.get_path("include", scheme="posix_prefix")),
        *_compiler_identity(),
    ]
    return parts + [t.encode() for t in text]


def build_dir(lib: Library, here: Path) -> Path:
    """Where the built library is kept: one directory per distinct set of ``build_inputs()``, so a
    change to any of them builds once into a new directory, and the same checkout and venv load
    their own build however many others share the cache."""
    h = hashlib.sha256()
    for part in build_inputs(lib, here):
        h.update(len(part).to_bytes(8, "little") + part)
    root = cache_root() or Path(tempfile.gettempdir())
    return root / "kernels" / f"{lib.prefix}-{h.hexdigest()[:16]}"


def missing_tools() -> Optional[str]:
    for tool in ("g++", "ninja"):
        if shutil.which(tool) is None and not (tool == "ninja" and _pip_ninja()):
            return f"`{tool}` is not installed (the Makefile's install step installs it)"
    return None


def _pip_ninja() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return True


def _library_stamp(directory: Path, name: str) -> Optional[Tuple[int, int, int]]:
    try:
        st = (directory / f"{name}.so").stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def build_and_load(lib: Library, here: Path, what: str) -> Optional[str]:
    """Build (first time) and load ``lib``; None when it is loaded, else why not. Safe to call from
    several processes at once (cpp_extension locks the build directory while building)."""
    _, why = usable_cache_root()
    if why is not None:
        return f"no place to build the {what}: {why}"
    from torch.utils import cpp_extension

    directory = build_dir(lib, here)
    unsafe = untrusted(directory, top=cache_root() or directory.parent)
    if unsafe is not None:  # a shared library is code: only from a directory nobody else can write
        return f"not building or loading the {what} in {directory}: {unsafe}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the {what}' build directory {directory} ({e}): point WORKBENCH_CACHE_DIR elsewhere"
    before, start = _library_stamp(directory, lib.name), time.perf_counter()
    try:
        cpp_extension.load(
            name=lib.name,
            sources=[str(here / s) for s in lib.sources],
            extra_cflags=list(lib.flags),
            extra_ldflags=list(lib.ldflags),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - a failed build makes the backend unavailable, with the reason
        lines = str(e).strip().splitlines() or [""]
        first_error = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
        return f"building the {what} in {directory} failed ({type(e).__name__}: {first_error.strip()[:300]})"
    if _library_stamp(directory, lib.name) != before:  # ninja relinked: a build, not a load of the cached library
        logger.warning("built the workbench %s in %s (%.1f s)", what, directory, time.perf_counter() - start)
    return None
