"""Every build of the CPU kernels, tested where it can run (workbench/ops/cpu_kernels/isa.py).

* The choice of variant, forced ones and their refusals, with the messages a user sees -- on every
  machine, by forcing them (``WORKBENCH_CPU_ISA``, a CPU's features monkeypatched).
* Every other variant this CPU runs (an AVX-512 machine runs the AVX2 build too) passes the kernel
  tests and the Q4 model's greedy tokens, each in a child process that loads that build.
* The ARM builds: the kernels' unit harness cross-compiled and run under qemu-user, and the ops'
  files compiled against torch's headers.
* With the kernels switched off the pipeline still runs, on torch's ops, and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.ops import cpu_kernels
from workbench.ops.cpu_kernels import harness, isa

ROOT = Path(__file__).resolve().parents[1]
X86_AVX2 = frozenset({"avx2", "fma", "f16c"})
X86_AVX512 = X86_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}




def test_auto_picks_the_best_variant_the_cpu_runs(cpu, monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    cpu("x86_64", X86_AVX512 | {"avx512_vnni"})
    assert isa.choose()[0].name == "avx512_vnni"
    cpu("x86_64", X86_AVX512)  # Skylake-SP: AVX-512 without VNNI
    assert isa.choose()[0].name == "avx512"
    cpu("x86_64", X86_AVX2)  # Zen 1-3, Intel Core since Haswell
    assert isa.choose()[0].name == "avx2"
    cpu("aarch64", {"asimd", "asimddp"})
    assert isa.choose()[0].name == "neon_dotprod"
    cpu("aarch64", {"asimd"})
    assert isa.choose()[0].name == "neon"


def test_a_cpu_without_a_variant_gets_the_reason(cpu, monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    cpu("x86_64", {"sse4_2", "avx"})  # Sandy Bridge
    assert isa.choose() == (None, "this CPU lacks avx2 fma f16c, which the AVX2 build needs")
    cpu("riscv64", {"rv64imafdc"})
    assert isa.choose() == (None, "no kernel variant is built for riscv64 CPUs (there are x86-64 and ARM64 ones)")


@pytest.mark.parametrize(
    "value, arch, features, expected",
    [
        ("none", "x86_64", X86_AVX512, (None, "switched off (WORKBENCH_CPU_ISA=none)")),
        ("AVX2", "x86_64", X86_AVX512, ("avx2", "")),  # any case; an AVX-512 CPU runs the AVX2 build
        (" ", "x86_64", X86_AVX2, ("avx2", "")),  # blank: auto
        ("avx512", "x86_64", X86_AVX2, (None, "WORKBENCH_CPU_ISA=avx512 needs CPU features this CPU lacks "
                                              "(avx512f avx512bw avx512vl avx512dq): unset it")),
        ("neon", "x86_64", X86_AVX2, (None, "WORKBENCH_CPU_ISA=neon is a build for aarch64 CPUs; this one is x86_64")),
        ("avx3", "x86_64", X86_AVX2, (None, "WORKBENCH_CPU_ISA='avx3' names no kernel variant: use one of auto, "
                                            "avx512_vnni, avx512, avx2, neon_dotprod, neon, none, or unset it")),
    ],
)
def test_forcing_a_variant(value, arch, features, expected, cpu, monkeypatch):
    monkeypatch.setenv(isa.ENV, value)
    cpu(arch, features)
    variant, why = isa.choose()
    assert (variant.name if variant else None, why) == expected


def test_forced_off_the_kernels_are_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setenv(isa.ENV, "none")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() == "switched off (WORKBENCH_CPU_ISA=none)"
        assert cpu_kernels.is_available(torch.device("cpu")) == (False, "switched off (WORKBENCH_CPU_ISA=none)")
        assert cpu_kernels.describe() == "no C++ kernels (switched off (WORKBENCH_CPU_ISA=none))"
        assert cpu_kernels.int8_dot() is None
    finally:
        cpu_kernels.load.cache_clear()


def test_a_second_variant_in_one_process_is_refused_with_the_reason(monkeypatch):
    why = cpu_kernels.load()
    if why is not None:
        pytest.skip(f"no kernels load in this process: {why}")
    loaded = cpu_kernels.loaded_variant()
    other = next(v for v in isa.VARIANTS if v.name != loaded)
    monkeypatch.setattr(isa, "choose", lambda: (other, ""))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() == (
            f"this process already runs the {loaded} build of the CPU kernels; one variant per process "
            f"(set WORKBENCH_CPU_ISA={other.name} before it starts)"
        )
    finally:
        cpu_kernels.load.cache_clear()


def _other_variants_this_cpu_runs():
    best = isa.choose()[0]
    arch, features = isa.machine_arch(), isa.cpu_features()
    return [v.name for v in isa.VARIANTS if v.arch == arch and not v.missing(features) and v is not best]


@pytest.mark.parametrize("variant", _other_variants_this_cpu_runs() or ["(none)"])
def test_every_other_variant_this_cpu_runs_passes_the_kernel_tests_and_keeps_the_q4_tokens(variant):
    """A child process per variant (one build per process): the kernels against the references; for
    the AVX2 build (another vector width than the AVX-512 ones) also the Q4_1 model's greedy README
    answer equal to the fp32 model's, exact and int8 activations. The AVX-512 builds differ from each
    other only in the int8 dot product, which the kernel tests cover."""
    if variant == "(none)":
        pytest.skip("this CPU runs one variant only: the rest of the suite tests it")
    env = {**os.environ, isa.ENV: variant}
    tests = ["tests/test_cpu_kernels.py"]
    if variant == "avx2":
        tests.append(
            "tests/test_gguf_model.py::test_q4_pipeline_uses_the_kernels_and_generates_the_fp32_models_tokens"
        )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    tail = "\n".join(done.stdout.splitlines()[-15:])
    assert done.returncode == 0, f"{variant}:\n{tail}\n{done.stderr[-2000:]}"
    assert " passed" in tail and "skipped" not in tail, tail


@pytest.mark.parametrize("variant", [v.name for v in isa.VARIANTS])
def test_the_unit_harness_passes_on_every_variant(variant):
    """harness.cpp (every kernel against scalar references, no torch) built for each variant: run
    natively where this CPU runs it, under qemu-aarch64 for the ARM builds; an x86 build this CPU
    cannot run is compiled only."""
    run = harness.run_harness(variant)
    if not run.ran:
        if run.output.startswith("compiled; not run"):
            return  # compiled for a CPU this one is not
        pytest.skip(run.output)  # the cross compiler or qemu is missing: the Makefile's test install adds them
    assert run.ok, run.output
    assert run.output.splitlines()[0].startswith(f"variant {variant},")
    assert run.output.strip().endswith("passed: 0 check(s) failed")


def test_the_arm_ops_compile_against_torchs_headers():
    """An op's own file (torch glue + the NEON vector layer + a kernel) for the ARM build most ARM CPUs
    run, with the cross compiler (syntax and types; linking needs an ARM libtorch). One file: the
    glue is ISA-neutral C++, and the harness above compiles every kernel for both ARM builds."""
    try:
        why = harness.compile_ops("neon_dotprod", sources=("linear.cpp",))
    except FileNotFoundError as e:
        pytest.skip(f"`{e}` is not installed (Debian package g++-aarch64-linux-gnu)")
    assert why is None, why
