"""The workbench's own CPU kernels (C++, AVX-512), built once per machine and cached on disk.

Three ops whose schemas are declared here and whose CPU kernels live in the ``.cpp`` files next to
this module; each is a drop-in backend for a canonical op (same arguments, same result up to fp32
summation order), put into graphs by the transforms that pick backends:

    op (torch.ops.workbench.*)   serves                    file
    cpu_linear                   linear (fp32 weights)      linear.cpp   <= 16 rows; more: aten.linear
    cpu_int4_linear              torch_int4_linear          linear.cpp   <= 16 rows; more: tiles to BLAS
    cpu_int4_linear_a8           torch_int4_linear          linear_a8.cpp  activations rounded to int8 per
                                 (approximately)            block of 32 (llama.cpp's Q8_1), VNNI dot products;
                                                            <= 16 rows; more: cpu_int4_linear (exact)
    cpu_int8_linear              torch_int8_linear          linear.cpp   idem
    cpu_cached_attention         torch_cached_attention     attention.cpp decode steps; prefill: reference
    cpu_rmsnorm                  torch_rmsnorm              elementwise.cpp  fp32; else reference
    cpu_rope_with_explicit_cos_sin  torch_rope_with_explicit_cos_sin  elementwise.cpp
    cpu_silu_and_mul             torch_silu_and_mul         elementwise.cpp

The same library holds ``torch.classes.workbench.StepProgram`` (``step_program.cpp``): a finished
graph as a list of boxed dispatcher calls, which the plain CPU runner steps with no Python per node
(``workbench/runtime/step_program.py``).

Why our own: at batch 1 a decode step is a chain of matrix-vector products over every weight. MKL's
fp32 GEMV streams ~24 GB/s here where the hardware gives ~30; ATen's int4 kernel wants bf16
activations (``bench/cpu_kernels.py`` measures all of them side by side); and the reference cached
attention spends ~200 us per layer in Python and SDPA set-up for a few hundred keys.

Build: ``torch.utils.cpp_extension.load`` (g++ and ninja; the Makefile installs both) into
``$WORKBENCH_CACHE_DIR/kernels/<hash of every build input>`` -- 20-80 s the first time on 2 cores,
then a load of the cached ``.so``; each build is logged with its directory and duration.
``make install`` builds it ahead of time. The hash covers what ninja compares, not only what the
library computes: ``build.ninja`` holds absolute paths (this checkout's sources, torch's headers and
libraries, the compiler), and ninja rebuilds when a command line changes, so two checkouts or venvs
sharing one directory would rebuild each other's library on every alternate run. Needs an x86 CPU
with AVX-512 (``torch.backends.cpu.get_cpu_capability()``) and a usable cache directory; otherwise
every op's backend reports itself unavailable with the reason, and the transforms keep the
reference ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ...cache_dir import cache_root, usable_cache_root
from ..library import declare_op
from ..quant.codecs import INT8_BLOCK_STEP

SOURCES = ("linear.cpp", "linear_a8.cpp", "attention.cpp", "elementwise.cpp", "step_program.cpp", "vec_math.h")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp",)
NAME = "workbench_cpu_kernels"
HERE = Path(__file__).resolve().parent
logger = logging.getLogger("workbench")


def _linear_fake(input, *args, **kwargs):
    weight = args[0]
    return input.new_empty(*input.shape[:-1], weight.shape[0])


declare_op("cpu_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", _linear_fake)
declare_op(
    "cpu_int4_linear(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
    "Tensor? bias=None) -> Tensor",
    _linear_fake,
)
declare_op(
    "cpu_int4_linear_a8(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
    "Tensor? bias=None) -> Tensor",
    _linear_fake,
    activation_rounding=INT8_BLOCK_STEP,
)
declare_op(
    "cpu_int8_linear(Tensor input, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor",
    _linear_fake,
)


declare_op(
    "cpu_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor",
    lambda input, weight, eps: torch.empty_like(input, dtype=torch.promote_types(input.dtype, weight.dtype)),
)
declare_op(
    "cpu_rope_with_explicit_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) "
    "-> (Tensor, Tensor)",
    lambda q, k, cos, sin, unsqueeze_dim=1: (torch.empty_like(q), torch.empty_like(k)),
)
declare_op(
    "cpu_silu_and_mul(Tensor input) -> Tensor", lambda input: input.new_empty(*input.shape[:-1], input.shape[-1] // 2)
)


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


def build_inputs() -> List[bytes]:
    """Everything the built library and its ``build.ninja`` depend on: the sources' contents and
    absolute paths, the flags, torch's version, headers and libraries, the Python that loads it (a
    venv's prefix and executable) and the compiler."""
    from torch.utils import cpp_extension

    parts = [str(HERE / name).encode() + b"\0" + (HERE / name).read_bytes() for name in SOURCES]
    text = [
        *FLAGS,
        *LDFLAGS,
        NAME,
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


def build_dir() -> Path:
    """Where the built library is kept: one directory per distinct set of ``build_inputs()``, so a
    change to any of them builds once into a new directory, and the same checkout and venv load
    their own build however many others share the cache."""
    h = hashlib.sha256()
    for part in build_inputs():
        h.update(len(part).to_bytes(8, "little") + part)
    root = cache_root() or Path(tempfile.gettempdir())
    return root / "kernels" / f"cpu-{h.hexdigest()[:16]}"


def _missing_prerequisite() -> Optional[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        return f"this CPU has no AVX-512 (torch reports {capability})"
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


def _library_stamp(directory: Path) -> Optional[Tuple[int, int, int]]:
    try:
        st = (directory / f"{NAME}.so").stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=None)
def load() -> Optional[str]:
    """Build (first time) and load the kernels; None when they are loaded, else why not. Safe to
    call from several processes at once (the build directory is locked while building)."""
    why = _missing_prerequisite()
    if why is not None:
        return why
    _, why = usable_cache_root()
    if why is not None:
        return f"no place to build the CPU kernels: {why}"
    # cpu_cached_attention's schema is declared by workbench.ops.attention, imported with this package
    from torch.utils import cpp_extension

    directory = build_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the CPU kernels' build directory {directory} ({e}): point WORKBENCH_CACHE_DIR elsewhere"
    before, start = _library_stamp(directory), time.perf_counter()
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(HERE / s) for s in SOURCES if s.endswith(".cpp")],
            extra_cflags=list(FLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - a failed build makes the backend unavailable, with the reason
        lines = str(e).strip().splitlines() or [""]
        first_error = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
        return f"building the CPU kernels in {directory} failed ({type(e).__name__}: {first_error.strip()[:300]})"
    if _library_stamp(directory) != before:  # ninja relinked: a build, not a load of the cached library
        logger.warning("built the workbench CPU kernels in %s (%.1f s)", directory, time.perf_counter() - start)
    return None


@functools.lru_cache(maxsize=None)
def has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (``cpu_int4_linear_a8``'s integer dot products; without it
    that op runs the exact int4 kernel). Read from /proc/cpuinfo: Linux x86 is where the kernels build."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return " avx512_vnni" in flags and " avx512vl" in flags


def is_available(device: torch.device) -> Tuple[bool, str]:
    """Backend hook: the kernels run on CPU tensors once built."""
    if torch.device(device).type != "cpu":
        return False, f"the workbench CPU kernels run on CPU tensors, not {torch.device(device).type}"
    why = load()
    return (why is None), (why or "")
