"""Which build of the CPU kernels this CPU runs: the variants, the CPU's features, and the choice.

The kernels are written once against ``vec.h`` and built once per variant, each with its own
compiler flags and ISA header (``simd/*.h``). At load the best variant the running CPU supports is
chosen, in the order below; ``WORKBENCH_CPU_ISA`` forces one (an AVX-512 machine runs the AVX2 build
too, so both are tested there) or, set to ``none``, switches the kernels off.

    variant        CPU needs (Linux /proc/cpuinfo names)       vector layer
    avx512_vnni    avx512f avx512bw avx512vl avx512dq avx512_vnni   simd/avx512.h, int8 dots by vpdpbusd
    avx512         avx512f avx512bw avx512vl avx512dq           simd/avx512.h, int8 dots by vpmaddubsw
    avx2           avx2 fma f16c                                 simd/avx2.h
    neon_dotprod   asimd asimddp                                 simd/neon.h, int8 dots by sdot
    neon           asimd                                         simd/neon.h, int8 dots by smull
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Optional, Tuple

ENV = "WORKBENCH_CPU_ISA"


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str  # "x86_64" or "aarch64"
    needs: Tuple[str, ...]  # CPU features, as Linux's /proc/cpuinfo names them
    flags: Tuple[str, ...]  # compiler flags (besides -O3 and OpenMP)
    title: str  # as the summary names it

    def missing(self, features: FrozenSet[str]) -> Tuple[str, ...]:
        return tuple(f for f in self.needs if f not in features)


_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DWB_ISA_AVX512")
VARIANTS: Tuple[Variant, ...] = (
    Variant(
        "avx512_vnni",
        "x86_64",
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
        (*_AVX512, "-mavx512vnni"),
        "AVX-512 + VNNI",
    ),
    Variant("avx512", "x86_64", ("avx512f", "avx512bw", "avx512vl", "avx512dq"), _AVX512, "AVX-512"),
    Variant("avx2", "x86_64", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DWB_ISA_AVX2"), "AVX2"),
    Variant(
        "neon_dotprod", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod", "-DWB_ISA_NEON"), "NEON + dotprod"
    ),
    Variant("neon", "aarch64", ("asimd",), ("-march=armv8-a", "-DWB_ISA_NEON"), "NEON"),
)
BY_NAME = {v.name: v for v in VARIANTS}
CHOICES = ("auto", *BY_NAME, "none")


def machine_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=None)
def cpu_features() -> FrozenSet[str]:
    """The running CPU's features under Linux's /proc/cpuinfo names: from /proc/cpuinfo on Linux, from
    sysctl on macOS, else what torch reports of its own kernels' capability (x86: AVX2 / AVX512)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():  # x86: "flags : ...", ARM: "Features : ..."
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    if sys.platform == "darwin":
        if machine_arch() == "aarch64":  # every Apple Silicon core has NEON; dotprod since M1
            return frozenset({"asimd"} | ({"asimddp"} if _sysctl("hw.optional.arm.FEAT_DotProd") == "1" else set()))
        found = (_sysctl("machdep.cpu.features") + " " + _sysctl("machdep.cpu.leaf7_features")).lower().split()
        rename = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
                  "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni"}  # fmt: skip
        return frozenset(rename[f] for f in found if f in rename)
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    if capability == "AVX2":
        return frozenset({"avx2", "fma", "f16c"})
    return frozenset({"asimd"}) if machine_arch() == "aarch64" else frozenset()


def cpu_model() -> str:
    """The CPU's model name, for benchmark headers ("" where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware"):
                return value.strip()
    except OSError:
        pass
    return _sysctl("machdep.cpu.brand_string") if sys.platform == "darwin" else platform.processor()


def requested() -> str:
    """``WORKBENCH_CPU_ISA`` as given (lower case), ``auto`` when unset or blank."""
    return os.environ.get(ENV, "").strip().lower() or "auto"


def choose() -> Tuple[Optional[Variant], str]:
    """``(variant, "")``: the build to load here; ``(None, why)``: none can run, or the kernels are
    switched off, with the reason."""
    asked = requested()
    arch, features = machine_arch(), cpu_features()
    if asked == "none":
        return None, f"switched off ({ENV}=none)"
    if asked != "auto":
        variant = BY_NAME.get(asked)
        if variant is None:
            return None, f"{ENV}={asked!r} names no kernel variant: use one of {', '.join(CHOICES)}, or unset it"
        if variant.arch != arch:
            return None, f"{ENV}={asked} is a build for {variant.arch} CPUs; this one is {arch}"
        missing = variant.missing(features)
        if missing:
            return None, f"{ENV}={asked} needs CPU features this CPU lacks ({' '.join(missing)}): unset it"
        return variant, ""
    for variant in VARIANTS:
        if variant.arch == arch and not variant.missing(features):
            return variant, ""
    have = [v for v in VARIANTS if v.arch == arch]
    if not have:
        return None, f"no kernel variant is built for {arch} CPUs (there are x86-64 and ARM64 ones)"
    return None, f"this CPU lacks {' '.join(have[-1].missing(features))}, which the {have[-1].title} build needs"
