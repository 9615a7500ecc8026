"""The workbench's own CPU kernels (C++, one source for AVX-512, AVX2 and NEON), built once per
machine and cached on disk.

The ops whose schemas are declared here have their CPU kernels in the ``.cpp`` files next to this
module; each is a drop-in backend for a canonical op (same arguments, same result up to fp32
summation order), put into graphs by the transforms that pick backends:

    op (torch.ops.workbench.*)   serves                    file
    cpu_linear                   linear (fp32 weights)      linear.cpp   <= 16 rows; more: aten.linear
    cpu_int4_linear              torch_int4_linear          linear.cpp   <= 96 rows; more: tiles to BLAS
    cpu_int4_linear_a8           torch_int4_linear          linear_a8.cpp  activations rounded to int8 per
                                 (approximately)            block of 32 (llama.cpp's Q8_1), integer dot
                                                            products; <= 16 rows; more: cpu_int4_linear (exact)
    cpu_int8_linear              torch_int8_linear          linear.cpp   idem
    cpu_cached_attention         torch_cached_attention     attention.cpp decode steps; prefill: reference
    cpu_rmsnorm                  torch_rmsnorm              elementwise.cpp  fp32; else reference
    cpu_rope_with_explicit_cos_sin  torch_rope_with_explicit_cos_sin  elementwise.cpp
    cpu_silu_and_mul             torch_silu_and_mul         elementwise.cpp

The kernels themselves (``*_kernel.h``) are written once against a small vector layer (``vec.h``)
with one header per ISA (``simd/avx512.h``, ``simd/avx2.h``, ``simd/neon.h``), and built once per
variant (``isa.py``: avx512_vnni, avx512, avx2, neon_dotprod, neon); the best variant the running
CPU supports is loaded, or the one ``WORKBENCH_CPU_ISA`` names. They use no torch type, so the unit
harness (``harness.cpp``, ``tools/cpu_kernel_harness.py``) builds them without torch, for ARM too.

A second library holds ``torch.classes.workbench.StepProgram`` (``step_program.cpp``): a finished
graph as a list of boxed dispatcher calls, which the plain CPU runner steps with no Python per node
(``workbench/runtime/step_program.py``). It uses no SIMD and builds wherever a C++ compiler is.

Why our own: at batch 1 a decode step is a chain of matrix-vector products over every weight at 4
or 8 bits, which torch has no fp32-activation kernel for (ATen's int4 kernel wants bf16
activations); and the reference cached attention spends ~100-200 us per layer in Python and SDPA
set-up for a few hundred keys. ``bench/cpu_kernels.py`` times every build against torch's ops;
which of them ``auto`` uses on a CPU is measured there (``calibrate.py``). Where no variant runs (another ISA, no compiler, an unusable cache
directory, ``WORKBENCH_CPU_ISA=none``) every op's backend reports itself unavailable with the
reason, and the transforms keep torch's ops (``build.py``: where and how the libraries are built).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..library import declare_op
from ..quant.codecs import INT8_BLOCK_STEP
from . import build, isa
from .build import HERE

logger = logging.getLogger("workbench")


def _linear_fake(input, *args, **kwargs):
    weight = args[0]
    return input.new_empty(*input.shape[:-1], weight.shape[0])


declare_op("cpu_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", _linear_fake, category="matmul")
declare_op(
    "cpu_int4_linear(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
    "Tensor? bias=None) -> Tensor",
    _linear_fake,
    category="quant",
)
declare_op(
    "cpu_int4_linear_a8(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
    "Tensor? bias=None) -> Tensor",
    _linear_fake,
    activation_rounding=INT8_BLOCK_STEP,
    category="quant",
)
declare_op(
    "cpu_int8_linear(Tensor input, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor",
    _linear_fake,
    category="quant",
)


declare_op(
    "cpu_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor",
    lambda input, weight, eps: torch.empty_like(input, dtype=torch.promote_types(input.dtype, weight.dtype)),
    category="norm",
    norm="rms",
)
declare_op(
    "cpu_rope_with_explicit_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) "
    "-> (Tensor, Tensor)",
    lambda q, k, cos, sin, unsqueeze_dim=1: (torch.empty_like(q), torch.empty_like(k)),
    category="elementwise",
)
declare_op(
    "cpu_silu_and_mul(Tensor input) -> Tensor",
    lambda input: input.new_empty(*input.shape[:-1], input.shape[-1] // 2),
    category="elementwise",
)


KERNEL_SOURCES = ("linear.cpp", "linear_a8.cpp", "attention.cpp", "elementwise.cpp")
# every header below this package: a build's cache key hashes them all, so a new header cannot be left out
KERNEL_HEADERS = tuple(sorted(p.relative_to(HERE).as_posix() for p in HERE.rglob("*.h")))
SOURCES = KERNEL_SOURCES + KERNEL_HEADERS + ("step_program.cpp",)  # every file a build reads
OPENMP = ("-fopenmp",)  # at::parallel_for's OpenMP region is compiled into the kernels
STEP_PROGRAM = build.Library("workbench_step_program", ("step_program.cpp",), (), ("-O3",), "step")


def kernel_library(variant: isa.Variant) -> build.Library:
    """The kernels' library for one variant: the same sources, that variant's flags and header."""
    return build.Library(
        f"workbench_cpu_kernels_{variant.name}",
        KERNEL_SOURCES,
        KERNEL_HEADERS,
        ("-O3", *variant.flags, *OPENMP),
        f"cpu-{variant.name}",
        OPENMP,
    )


def build_dir(variant: Optional[isa.Variant] = None) -> Path:
    """The build directory of the kernels' library for ``variant`` (default: the one chosen here;
    avx2 where none is)."""
    variant = variant or isa.choose()[0] or isa.BY_NAME["avx2"]
    return build.build_dir(kernel_library(variant), HERE)


def _missing_prerequisite() -> Optional[str]:
    variant, why = isa.choose()
    return why if variant is None else build.missing_tools()


@functools.lru_cache(maxsize=None)
def load() -> Optional[str]:
    """Build (first time) and load the kernels' variant for this CPU; None when they are loaded,
    else why not. One variant per process: the ops are registered once."""
    why = _missing_prerequisite()
    if why is not None:
        if isa.requested() not in ("auto", "none"):  # asked for by name: say so now, not only in the summary
            logger.warning("workbench CPU kernels: %s", why)
        return why
    variant = isa.choose()[0]
    assert variant is not None
    loaded = loaded_variant()
    if loaded is not None and loaded != variant.name:
        return (
            f"this process already runs the {loaded} build of the CPU kernels; one variant per process "
            f"(set {isa.ENV}={variant.name} before it starts)"
        )
    if loaded is not None:
        # Already loaded (a cleared cache of this function, another WORKBENCH_CACHE_DIR): loading a
        # second copy would register the same ops twice, which aborts the process.
        return None
    why = build.build_and_load(kernel_library(variant), HERE, "CPU kernels")
    if why is None and loaded_variant() != variant.name:
        return f"the CPU kernels' library loaded but reports the {loaded_variant()} build, not {variant.name}"
    return why


@functools.lru_cache(maxsize=None)
def load_step_program() -> Optional[str]:
    """Build (first time) and load the step program's library; None when loaded, else why not."""
    if _step_program_loaded():
        return None  # registered already: a second copy would abort the process (see load())
    return build.missing_tools() or build.build_and_load(STEP_PROGRAM, HERE, "step program")


def _step_program_loaded() -> bool:
    try:
        torch.classes.workbench.StepProgram  # noqa: B018 - raises until the library is loaded
    except (AttributeError, RuntimeError):
        return False
    return True


def loaded_variant() -> Optional[str]:
    """The variant of the kernels' library this process has loaded ("avx2", ...), None before."""
    if not hasattr(torch.ops.workbench, "cpu_kernels_isa"):
        return None
    return str(torch.ops.workbench.cpu_kernels_isa())


def describe() -> str:
    """The kernels as the summary names them: "C++ kernels, AVX2 build" or why there are none."""
    why = load()
    if why is not None:
        return f"no C++ kernels ({why})"
    variant = isa.BY_NAME[str(loaded_variant())]
    return f"C++ kernels, {variant.title} build"


def int8_dot() -> Optional[str]:
    """How ``cpu_int4_linear_a8`` multiplies bytes on this build ("AVX2 vpmaddubsw", ...); None
    where the kernels are not loaded."""
    if load() is not None:
        return None
    return str(torch.ops.workbench.cpu_kernels_int8_dot())


def is_available(device: torch.device) -> Tuple[bool, str]:
    """Backend hook: the kernels run on CPU tensors once built."""
    if torch.device(device).type != "cpu":
        return False, f"the workbench CPU kernels run on CPU tensors, not {torch.device(device).type}"
    why = load()
    return (why is None), (why or "")
