"""Build and run the kernels' unit harness (``harness.cpp``) for one variant, natively or, for a
variant of another architecture, with a cross compiler and qemu-user.

    python -m workbench.ops.cpu_kernels.harness              # every variant this machine can run or emulate
    python -m workbench.ops.cpu_kernels.harness neon avx2

The harness needs no torch, so an ARM variant is built by Debian's ``aarch64-linux-gnu-g++``
(package ``g++-aarch64-linux-gnu``), linked statically and run by ``qemu-aarch64`` (``qemu-user``).
``compile_ops`` checks that the ops' own files (with torch's headers) compile for a variant too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from . import KERNEL_SOURCES, isa
from .build import HERE

CROSS = {"aarch64": ("aarch64-linux-gnu-g++", "qemu-aarch64", "g++-aarch64-linux-gnu", "qemu-user")}


@dataclass
class HarnessRun:
    variant: str
    ok: bool
    output: str  # the harness's lines, or why it did not run
    ran: bool = True  # False: a tool is missing (output says which)


def _tools(variant: isa.Variant) -> tuple:
    """(compiler, runner prefix, why not) for building and running ``variant`` here."""
    if variant.arch == isa.machine_arch():
        missing = variant.missing(isa.cpu_features())
        if missing:  # an x86 variant this CPU cannot run: it can still be compiled
            return "g++", None, f"this CPU lacks {' '.join(missing)}"
        return "g++", [], None
    if variant.arch not in CROSS or isa.machine_arch() != "x86_64":
        return None, None, f"no cross toolchain for {variant.arch} on {isa.machine_arch()}"
    compiler, emulator, cpkg, epkg = CROSS[variant.arch]
    if shutil.which(compiler) is None:
        return None, None, f"`{compiler}` is not installed (Debian package {cpkg})"
    if shutil.which(emulator) is None:
        return compiler, None, f"`{emulator}` is not installed (Debian package {epkg})"
    return compiler, [emulator, "-cpu", "max"], None


def run_harness(name: str, timeout: float = 300) -> HarnessRun:
    """Compile ``harness.cpp`` for variant ``name`` and run it (natively or under qemu)."""
    variant = isa.BY_NAME[name]
    compiler, runner, why = _tools(variant)
    if compiler is None:
        return HarnessRun(name, False, why or "", ran=False)
    with tempfile.TemporaryDirectory(prefix="workbench-harness-") as tmp:
        exe = Path(tmp) / f"harness_{name}"
        flags = [f for f in variant.flags if f != "-fopenmp"]
        cmd = [compiler, "-std=c++20", "-O2", "-DWB_STANDALONE", *flags, str(HERE / "harness.cpp"), "-o", str(exe)]
        if variant.arch != isa.machine_arch():
            cmd.append("-static")  # qemu-user runs it without an ARM sysroot
        built = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if built.returncode != 0:
            return HarnessRun(name, False, f"compiling the harness failed:\n{built.stderr[-3000:]}")
        if runner is None:
            return HarnessRun(name, False, f"compiled; not run: {why}", ran=False)
        done = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=timeout)
        return HarnessRun(name, done.returncode == 0, done.stdout + done.stderr)


def compile_ops(name: str, sources: Sequence[str] = KERNEL_SOURCES, timeout: float = 600) -> Optional[str]:
    """Compile (syntax and types: ``-fsyntax-only``) the ops' ``.cpp`` files (``sources``) for variant
    ``name`` against torch's headers, with the cross compiler for another architecture. None when
    they compile, else the first error; raises FileNotFoundError when the compiler is missing."""
    from torch.utils import cpp_extension

    variant = isa.BY_NAME[name]
    compiler = "g++" if variant.arch == isa.machine_arch() else CROSS[variant.arch][0]
    if shutil.which(compiler) is None:
        raise FileNotFoundError(compiler)
    includes: List[str] = []
    for path in cpp_extension.include_paths():
        includes += ["-isystem", path]
    for source in sources:
        cmd = [
            compiler,
            "-std=c++20",
            "-fsyntax-only",
            "-O2",
            "-fopenmp",
            *variant.flags,
            *includes,
            str(HERE / source),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
            return f"{source}: {(errors or done.stderr.splitlines() or ['?'])[0]}"
    return None


def main(argv: Sequence[str]) -> int:
    names = list(argv) or [v.name for v in isa.VARIANTS]
    failed = 0
    for name in names:
        run = run_harness(name)
        status = "passed" if run.ok else ("not run" if not run.ran else "FAILED")
        print(f"{name}: {status}")
        if not run.ok:
            print("  " + run.output.strip().replace("\n", "\n  "))
        failed += run.ran and not run.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
