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

Why our own: at batch 1 a decode step is a chain of matrix-vector products over every weight. MKL's
fp32 GEMV streams ~24 GB/s here where the hardware gives ~30; ATen's int4 kernel wants bf16
activations (``bench/cpu_kernels.py`` measures all of them side by side); and the reference cached
attention spends ~200 us per layer in Python and SDPA set-up for a few hundred keys.

Build: ``torch.utils.cpp_extension.load`` (g++ and ninja; the Makefile installs both) into
``$WORKBENCH_CACHE_DIR/kernels/<hash of sources, flags, torch version>`` -- about 10 s the first
time on 2 cores, then a load of the cached ``.so``. ``make install`` builds it ahead of time.
Needs an x86 CPU with AVX-512 (``torch.backends.cpu.get_cpu_capability()``); elsewhere every op's
backend reports itself unavailable with the reason, and the transforms keep the reference ops.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch

from ...cache_dir import cache_root
from ..library import declare_op

SOURCES = ("linear.cpp", "linear_a8.cpp", "attention.cpp", "elementwise.cpp", "vec_math.h")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-fopenmp")
HERE = Path(__file__).resolve().parent


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


def build_dir() -> Path:
    """Where the built library is kept: keyed by the sources, flags and torch build, so a change to
    any of them builds again instead of loading a stale library."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    h.update(" ".join(FLAGS).encode() + torch.__version__.encode())
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


@functools.lru_cache(maxsize=None)
def load() -> Optional[str]:
    """Build (first time) and load the kernels; None when they are loaded, else why not. Safe to
    call from several processes at once (the build directory is locked while building)."""
    why = _missing_prerequisite()
    if why is not None:
        return why
    # cpu_cached_attention's schema is declared by workbench.ops.attention, imported with this package
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name="workbench_cpu_kernels",
            sources=[str(HERE / s) for s in SOURCES if s.endswith(".cpp")],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - a failed build makes the backend unavailable, with the reason
        lines = str(e).strip().splitlines() or [""]
        first_error = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
        return f"building the CPU kernels in {directory} failed ({type(e).__name__}: {first_error.strip()[:300]})"
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
