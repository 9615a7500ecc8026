"""Every "cannot run here" message of the op backends, tested on every machine by forcing it.

The suites of the backends themselves skip where a backend cannot run (``tests/test_cpu_kernels.py``
without the C++ kernels, the Triton tests without triton), which leaves the message a user sees on
exactly those machines untested there. Each test here forces one reason by monkeypatching the probe
the backend reads (the compiler on PATH, the CPU's ISA, the cache directory, the triton package, CUDA,
the flashinfer package, numpy's and triton's versions) and asserts the exact text: what is missing and
what to do. Nothing here is skipped, builds a library or needs a GPU.

* C++ CPU kernels (``workbench/ops/cpu_kernels``): ``is_available``/``load`` for a non-CPU device,
  every ISA refusal (``isa.choose``), no g++ / no ninja, a second variant in one process, every
  cache-directory refusal of the build, a failed build, a library that reports another build; the
  step program's reasons; ``describe()`` and ``python -m workbench.ops.cpu_kernels``.
* Triton (``ops/triton_support.py``): no triton, no CUDA, CPU without the interpreter, the
  interpreter's numpy clash, and ``require_triton``'s error.
* FlashInfer (``ops/flashinfer_support.py``): the package missing, a non-CUDA device, no GPU.
* What the backend tables make of a reason: ``BackendRegistry.pick``'s error names the reason, the
  backend's requirement and the backend to pick instead.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import logging
import os
import runpy
import shutil
import sys
import types

import numpy
import pytest
import torch
from torch.utils import cpp_extension

import workbench.ops  # noqa: F401 - registers every op
from workbench.ops import cpu_kernels, flashinfer_support, triton_support
from workbench.ops.backends import FUSION_BACKENDS
from workbench.ops.cpu_kernels import build, isa

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device type only: nothing here allocates on it
X86_AVX2 = frozenset({"avx2", "fma", "f16c"})
NO_GXX = "`g++` is not installed (the Makefile's install step installs it)"
NO_NINJA = "`ninja` is not installed (the Makefile's install step installs it)"


# ---------------------------------------------------------------------------------------------- probes


@pytest.fixture
def fresh(monkeypatch):
    """``load()`` and ``load_step_program()`` answered again under the test's probes, as in a process
    that has loaded neither library, and forgotten after the test (the next caller gets this process's
    real answer back)."""
    monkeypatch.delenv(isa.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "loaded_variant", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_step_program_loaded", lambda: False)
    cpu_kernels.load.cache_clear()
    cpu_kernels.load_step_program.cache_clear()
    yield
    cpu_kernels.load.cache_clear()
    cpu_kernels.load_step_program.cache_clear()


@pytest.fixture
def tools(monkeypatch):
    """``tools(*missing)``: the named build tools are not on PATH (nor ninja from pip); the rest are."""

    def without(*missing: str) -> None:
        real = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name in missing else real(name, *a, **k))
        if "ninja" in missing:
            monkeypatch.setattr(build, "_pip_ninja", lambda: False)

    return without


@pytest.fixture
def builds(monkeypatch, fresh, cpu, tmp_path):
    """Past every prerequisite, at the build: an AVX2 CPU with g++ and ninja, the cache in a fresh
    private directory (returned). No test compiles: ``cpp_extension.load`` fails the test unless the
    test replaces it."""
    cpu("x86_64", X86_AVX2)
    monkeypatch.setattr(build, "missing_tools", lambda: None)  # g++ and ninja: their absence is tested above
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail(f"compiled {kw['name']} in a message test"))
    return root


def cpu_kernels_reason() -> str:
    """Why the CPU kernels are unavailable, as the backend tables ask (``is_available``); asserts
    that ``load()`` and ``describe()`` give the same reason."""
    ok, why = cpu_kernels.is_available(CPU)
    assert not ok and why
    assert cpu_kernels.load() == why
    assert cpu_kernels.describe() == f"no C++ kernels ({why})"
    assert cpu_kernels.int8_dot() is None
    return why


# ---------------------------------------------------------------------------------------------- CPU kernels
def test_cpu_kernels_on_a_non_cpu_device():
    assert cpu_kernels.is_available(CUDA) == (False, "the workbench CPU kernels run on CPU tensors, not cuda")
    assert cpu_kernels.is_available(torch.device("meta")) == (
        False,
        "the workbench CPU kernels run on CPU tensors, not meta",
    )


@pytest.mark.parametrize(
    "asked, arch, features, why",
    [
        ("none", "x86_64", X86_AVX2, "switched off (WORKBENCH_CPU_ISA=none)"),
        (
            "avx3",
            "x86_64",
            X86_AVX2,
            "WORKBENCH_CPU_ISA='avx3' names no kernel variant: use one of auto, avx512_vnni, avx512, avx2, "
            "neon_dotprod, neon, none, or unset it",
        ),
        ("neon", "x86_64", X86_AVX2, "WORKBENCH_CPU_ISA=neon is a build for aarch64 CPUs; this one is x86_64"),
        (
            "avx512_vnni",
            "x86_64",
            X86_AVX2,
            "WORKBENCH_CPU_ISA=avx512_vnni needs CPU features this CPU lacks "
            "(avx512f avx512bw avx512vl avx512dq avx512_vnni): unset it",
        ),
        ("", "x86_64", {"sse4_2", "avx"}, "this CPU lacks avx2 fma f16c, which the AVX2 build needs"),
        ("", "aarch64", set(), "this CPU lacks asimd, which the NEON build needs"),
        (
            "",
            "riscv64",
            {"rv64imafdc"},
            "no kernel variant is built for riscv64 CPUs (there are x86-64 and ARM64 ones)",
        ),
    ],
    ids=["switched-off", "unknown-name", "other-arch", "missing-features", "old-x86", "arm-without-neon", "riscv"],
)
def test_cpu_kernels_without_a_variant_for_this_cpu(asked, arch, features, why, monkeypatch, fresh, cpu, tools):
    monkeypatch.setenv(isa.ENV, asked)
    cpu(arch, features)
    tools("g++", "ninja")  # the CPU's reason comes first: a compiler would not help
    assert cpu_kernels_reason() == why


def test_cpu_kernels_without_gxx(fresh, cpu, tools):
    cpu("x86_64", X86_AVX2)
    tools("g++")
    assert cpu_kernels_reason() == NO_GXX


def test_cpu_kernels_without_ninja(fresh, cpu, tools):
    cpu("x86_64", X86_AVX2)
    tools("ninja")
    assert cpu_kernels_reason() == NO_NINJA


def test_cpu_kernels_second_variant_in_one_process(monkeypatch, fresh, cpu):
    cpu("x86_64", X86_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setattr(build, "missing_tools", lambda: None)
    monkeypatch.setattr(cpu_kernels, "loaded_variant", lambda: "avx2")  # loaded before, e.g. forced by the env
    assert cpu_kernels.load() == (
        "this process already runs the avx2 build of the CPU kernels; one variant per process "
        "(set WORKBENCH_CPU_ISA=avx512 before it starts)"
    )


def test_cpu_kernels_with_a_file_as_cache_dir(builds, monkeypatch):
    a_file = builds.parent / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file))
    assert cpu_kernels_reason() == (
        f"no place to build the CPU kernels: WORKBENCH_CACHE_DIR={a_file} is a file, not a directory: "
        "point WORKBENCH_CACHE_DIR at a writable directory or set it to off"
    )


def test_cpu_kernels_with_a_cache_dir_under_a_file(builds, monkeypatch):
    a_file = builds.parent / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file / "cache"))
    assert cpu_kernels_reason() == (
        f"no place to build the CPU kernels: WORKBENCH_CACHE_DIR={a_file / 'cache'} cannot be created because "
        f"{a_file} is a file: point WORKBENCH_CACHE_DIR at a writable directory or set it to off"
    )


def test_cpu_kernels_with_a_read_only_cache_dir(builds, monkeypatch):
    real_access = os.access  # root may write anywhere: the permission probe is what is forced
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(builds) else real_access(p, mode))
    assert cpu_kernels_reason() == (
        f"no place to build the CPU kernels: WORKBENCH_CACHE_DIR={builds} is not writable (no write "
        f"permission on {builds}): point WORKBENCH_CACHE_DIR at a writable directory or set it to off"
    )


def test_cpu_kernels_with_a_cache_dir_others_can_write(builds):
    builds.chmod(0o777)
    assert cpu_kernels_reason() == (
        f"not building or loading the CPU kernels in {cpu_kernels.build_dir()}: {builds} is writable by "
        f"everyone (mode 777), so another user could put code there: chmod go-w {builds}"
    )


def test_cpu_kernels_with_a_cache_dir_of_another_user(builds, monkeypatch):
    real_stat = os.stat

    def stat(path, *args, **kwargs):  # the cache root as another user's (uid 4242)
        st = real_stat(path, *args, **kwargs)
        if str(path) != str(builds):
            return st
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 4242, *tuple(st)[5:]))

    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(os, "stat", stat)
    assert cpu_kernels_reason() == (
        f"not building or loading the CPU kernels in {cpu_kernels.build_dir()}: {builds} belongs to another user "
        "(uid 4242): use a cache directory of your own (WORKBENCH_CACHE_DIR)"
    )


def test_cpu_kernels_when_the_build_directory_cannot_be_made(builds):
    (builds / "kernels").write_text("")  # a file where the directory of every build goes
    directory = cpu_kernels.build_dir()
    assert cpu_kernels_reason() == (
        f"cannot create the CPU kernels' build directory {directory} ([Errno {errno.ENOTDIR}] "
        f"{os.strerror(errno.ENOTDIR)}: '{directory}'): point WORKBENCH_CACHE_DIR elsewhere"
    )


def test_cpu_kernels_when_the_build_fails(builds, monkeypatch):
    def failed_build(**kwargs):
        raise RuntimeError(
            "Error building extension 'workbench_cpu_kernels_avx2': [1/5] c++ -MMD linear.cpp\n"
            "linear.cpp:3:10: fatal error: vec.h: No such file or directory\n"
            "ninja: build stopped: subcommand failed."
        )

    monkeypatch.setattr(cpp_extension, "load", failed_build)
    assert cpu_kernels_reason() == (
        f"building the CPU kernels in {cpu_kernels.build_dir()} failed (RuntimeError: Error building extension "
        "'workbench_cpu_kernels_avx2': [1/5] c++ -MMD linear.cpp)"
    )


def test_cpu_kernels_library_that_reports_another_build(builds, monkeypatch):
    calls = []  # before the load: nothing loaded; after it, the library's own answer

    def loaded_variant():
        calls.append(1)
        return None if len(calls) == 1 else "avx512"

    monkeypatch.setattr(cpu_kernels, "loaded_variant", loaded_variant)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)
    assert cpu_kernels.load() == "the CPU kernels' library loaded but reports the avx512 build, not avx2"


def test_step_program_without_gxx(fresh, tools):
    tools("g++")
    assert cpu_kernels.load_step_program() == NO_GXX


def test_step_program_when_the_build_fails(builds, monkeypatch):
    def failed_build(**kwargs):
        raise RuntimeError("Error building extension 'workbench_step_program'")

    monkeypatch.setattr(cpp_extension, "load", failed_build)
    directory = build.build_dir(cpu_kernels.STEP_PROGRAM, cpu_kernels.HERE)
    assert cpu_kernels.load_step_program() == (
        f"building the step program in {directory} failed (RuntimeError: Error building extension "
        "'workbench_step_program')"
    )


def test_make_install_step_prints_both_reasons(monkeypatch, fresh, cpu, tools, capsys):
    """``python -m workbench.ops.cpu_kernels`` (the Makefile's install step) with the kernels switched
    off and no g++: one line per library, each with its reason."""
    monkeypatch.setenv(isa.ENV, "none")
    cpu("x86_64", X86_AVX2)
    tools("g++")
    monkeypatch.setattr(isa, "cpu_model", lambda: "Test CPU")
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # the script's; the test's logging stays
    runpy.run_module("workbench.ops.cpu_kernels", run_name="__main__")
    assert capsys.readouterr().out.splitlines() == [
        "workbench CPU kernels: unavailable: switched off (WORKBENCH_CPU_ISA=none)",
        "  CPU: Test CPU; no C++ kernels (switched off (WORKBENCH_CPU_ISA=none))",
        f"workbench step program: unavailable: {NO_GXX}",
    ]


# ---------------------------------------------------------------------------------------------- Triton
@pytest.fixture
def triton_installed(monkeypatch):
    """``triton_installed(flag)``: the triton package found or not (``HAS_TRITON``, read at import)."""
    return lambda flag: monkeypatch.setattr(triton_support, "HAS_TRITON", flag)


@pytest.fixture
def versions(monkeypatch):
    """``versions(triton, numpy)``: the installed triton's and numpy's versions as the interpreter
    check reads them (a stand-in triton module where it is not installed)."""

    def pretend(triton_version: str, numpy_version: str) -> None:
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
        monkeypatch.setattr(numpy, "__version__", numpy_version)

    return pretend


def cuda_visible(monkeypatch, flag: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: flag)


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_triton_not_installed(device, triton_installed, monkeypatch):
    triton_installed(False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_support.triton_available(device) == (False, "the 'triton' package is not installed")


def test_triton_without_cuda(triton_installed, monkeypatch):
    triton_installed(True)
    cuda_visible(monkeypatch, False)
    assert triton_support.triton_available(CUDA) == (False, "CUDA is not available")
    assert triton_support.triton_available() == (False, "CUDA is not available")  # the default device
    cuda_visible(monkeypatch, True)
    assert triton_support.triton_available(CUDA) == (True, "triton on CUDA")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_triton_on_a_device_it_does_not_compile_for(device, triton_installed, monkeypatch):
    triton_installed(True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_support.triton_available(device) == (
        False,
        f"triton does not compile for {device} tensors (on CPU it runs only under the interpreter: set "
        "TRITON_INTERPRET=1 before triton is imported)",
    )


def test_triton_interpreter_with_a_numpy_it_cannot_run_with(triton_installed, versions, monkeypatch):
    triton_installed(True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    versions("3.6.0", "2.4.1")
    clash = "triton 3.6.0's interpreter cannot run with numpy 2.4.1 (it needs numpy < 2.4, or triton >= 3.7)"
    assert triton_support.interpreter_numpy_clash() == clash
    assert triton_support.triton_available(CPU) == (False, clash)


@pytest.mark.parametrize("triton_version, numpy_version", [("3.6.0", "2.3.5"), ("3.7.0", "2.4.1"), ("3.9.0", "2.4.6")])
def test_triton_interpreter_without_the_clash(triton_version, numpy_version, triton_installed, versions, monkeypatch):
    triton_installed(True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    versions(triton_version, numpy_version)
    assert triton_support.interpreter_numpy_clash() == ""
    assert triton_support.triton_available(CPU) == (True, "triton interpreter (TRITON_INTERPRET=1) on CPU tensors")


def test_require_triton_names_the_op_the_reason_and_the_torch_backend(triton_installed, monkeypatch):
    triton_installed(True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError) as raised:
        triton_support.require_triton(CPU, "triton_cached_ssm", "insert_cached_ssm_attention.backend=torch")
    assert str(raised.value) == (
        "triton_cached_ssm cannot run on cpu: triton does not compile for cpu tensors (on CPU it runs only under "
        "the interpreter: set TRITON_INTERPRET=1 before triton is imported). Use the 'torch' backend "
        "(insert_cached_ssm_attention.backend=torch) on this device."
    )
    triton_installed(False)
    with pytest.raises(RuntimeError) as raised:
        triton_support.require_triton(CUDA, "triton_cached_ssm", "insert_cached_ssm_attention.backend=torch")
    assert str(raised.value) == (
        "triton_cached_ssm cannot run on cuda: the 'triton' package is not installed. Use the 'torch' backend "
        "(insert_cached_ssm_attention.backend=torch) on this device."
    )


# ---------------------------------------------------------------------------------------------- FlashInfer
FLASHINFER_MISSING = (
    "the flashinfer package is not installed (optional package missing: flashinfer-python; "
    "pip install flashinfer-python, or make wheelhouse for a machine without network)"
)
NO_GPU = "no CUDA GPU is visible (FlashInfer kernels are GPU-only)"


@pytest.fixture
def flashinfer_installed(monkeypatch):
    """``flashinfer_installed(flag)``: the flashinfer package found or not (its import spec)."""

    def pretend(flag: bool) -> None:
        real = importlib.util.find_spec
        found = importlib.machinery.ModuleSpec("flashinfer", None)
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, **k: (found if flag else None) if name == "flashinfer" else real(name, *a, **k),
        )

    return pretend


@pytest.mark.parametrize(
    "installed, device, gpu, expected",
    [
        (False, CUDA, True, (False, FLASHINFER_MISSING)),
        (False, None, False, (False, f"{FLASHINFER_MISSING}; {NO_GPU}")),
        (True, None, False, (False, NO_GPU)),
        (True, CUDA, False, (False, NO_GPU)),
        (True, CPU, True, (False, "the pipeline device is cpu; FlashInfer kernels need CUDA tensors")),
        (
            False,
            CPU,
            False,
            (False, f"{FLASHINFER_MISSING}; the pipeline device is cpu; FlashInfer kernels need CUDA tensors"),
        ),
        (True, CUDA, True, (True, "flashinfer on CUDA")),
    ],
    ids=["missing", "missing-no-gpu", "no-gpu", "cuda-no-gpu", "cpu-device", "missing-cpu-device", "available"],
)
def test_flashinfer_reasons(installed, device, gpu, expected, flashinfer_installed, monkeypatch):
    flashinfer_installed(installed)
    cuda_visible(monkeypatch, gpu)
    assert flashinfer_support.flashinfer_available(device) == expected


# ---------------------------------------------------------------------------------------------- as the tables say it
def _pick_error(backend: str, device: torch.device) -> str:
    table = FUSION_BACKENDS["rmsnorm"]
    with pytest.raises(RuntimeError) as raised:
        table.pick(backend, device, "fuse_rmsnorm.backend")
    return str(raised.value)


def test_the_tables_name_the_reason_the_need_and_the_backend_to_pick(
    monkeypatch, fresh, triton_installed, flashinfer_installed
):
    """A requested backend that cannot run is refused by ``BackendRegistry.pick`` with the module's
    reason, what the backend needs and the one that runs here (only torch: every other one forced off)."""
    monkeypatch.setenv(isa.ENV, "none")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_installed(False)
    flashinfer_installed(False)
    cuda_visible(monkeypatch, False)
    need = {b.name: b.requirement for b in FUSION_BACKENDS["rmsnorm"]}
    instead = "Pick backend 'torch' (fuse_rmsnorm.backend=torch) instead."
    assert _pick_error("cpu", CPU) == (
        f"rmsnorm backend 'cpu' cannot run on cpu: switched off (WORKBENCH_CPU_ISA=none). It needs {need['cpu']}. "
        + instead
    )
    assert _pick_error("cpu", CUDA) == (
        f"rmsnorm backend 'cpu' cannot run on cuda: the workbench CPU kernels run on CPU tensors, not cuda. "
        f"It needs {need['cpu']}. {instead}"
    )
    assert _pick_error("triton", CUDA) == (
        f"rmsnorm backend 'triton' cannot run on cuda: the 'triton' package is not installed. "
        f"It needs {need['triton']}. {instead}"
    )
    assert _pick_error("flashinfer", CUDA) == (
        f"rmsnorm backend 'flashinfer' cannot run on cuda: {FLASHINFER_MISSING}; {NO_GPU}. "
        f"It needs {need['flashinfer']}. {instead}"
    )
    triton_installed(True)
    assert _pick_error("triton", CUDA) == (
        f"rmsnorm backend 'triton' cannot run on cuda: CUDA is not available. It needs {need['triton']}. {instead}"
    )
