"""Where the C++ CPU kernels are built and cached (workbench/ops/cpu_kernels.build_dir, load).

No test here compiles: the build directory is a pure function of the build inputs, and the build
itself is replaced by a stand-in where only its effect on the directory matters.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from workbench import cache_dir
from workbench.ops import cpu_kernels


@pytest.fixture
def fresh_load(monkeypatch):
    """``load()`` computed again under this test's environment as in a fresh process, on any CPU
    (the avx2 build chosen, its library reporting itself as that once built and loaded here), and
    forgotten after it. (A process that has loaded the library answers ``load()`` without building:
    a second copy would register its ops twice.)"""
    avx2 = cpu_kernels.isa.BY_NAME["avx2"]
    monkeypatch.setattr(cpu_kernels.isa, "choose", lambda: (avx2, ""))
    monkeypatch.setattr(cpu_kernels.build, "missing_tools", lambda: None)
    loaded = {"variant": None}
    real = cpu_kernels.build.build_and_load

    def build_and_load(*args, **kwargs):
        why = real(*args, **kwargs)
        loaded["variant"] = "avx2" if why is None else loaded["variant"]
        return why

    monkeypatch.setattr(cpu_kernels.build, "build_and_load", build_and_load)
    monkeypatch.setattr(cpu_kernels, "loaded_variant", lambda: loaded["variant"])
    cpu_kernels.load.cache_clear()
    yield
    cpu_kernels.load.cache_clear()


def _copy_sources(dest):
    for name in cpu_kernels.SOURCES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(cpu_kernels.HERE / name, dest / name)
    return dest


def test_build_dir_is_stable_and_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build_dir()
    assert first == cpu_kernels.build_dir()
    assert first.parent == tmp_path / "kernels" and first.name.startswith("cpu-")
    # one directory per variant: the same sources under other flags and another ISA header
    names = {cpu_kernels.build_dir(v).name.rsplit("-", 1)[0] for v in cpu_kernels.isa.VARIANTS}
    assert names == {f"cpu-{v.name}" for v in cpu_kernels.isa.VARIANTS}


@pytest.mark.parametrize(
    "change", ["checkout", "source", "prefix", "executable", "compiler", "torch_headers", "torch_version"]
)
def test_each_build_input_gets_its_own_directory(change, tmp_path, monkeypatch):
    """Two checkouts or venvs on one machine must not share a directory: ninja would see other
    absolute paths in each one's build.ninja and rebuild on every alternate run."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    original = before = cpu_kernels.build_dir()
    if change in ("checkout", "source"):
        clone = _copy_sources(tmp_path / "clone")
        monkeypatch.setattr(cpu_kernels, "HERE", clone)
        if change == "source":
            assert cpu_kernels.build_dir() != before  # same contents, other paths
            before = cpu_kernels.build_dir()
            (clone / "linear.cpp").write_text((clone / "linear.cpp").read_text() + "\n// edited\n")
    elif change == "prefix":
        monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    elif change == "executable":
        monkeypatch.setattr(sys, "executable", str(tmp_path / "other-venv" / "bin" / "python"))
    elif change == "compiler":
        monkeypatch.setenv("CXX", "clang++-that-is-not-c++")
    elif change == "torch_headers":
        monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [str(tmp_path / "include")])
    elif change == "torch_version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    after = cpu_kernels.build_dir()
    assert after != before and after.parent == before.parent
    monkeypatch.undo()
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.build_dir() == original  # every input back as it was: the same directory again


def test_cache_root_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", "off")
    assert cache_dir.usable_cache_root() == (None, None)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "new" / "dir"))
    assert cache_dir.usable_cache_root() == (tmp_path / "new" / "dir", None)
    assert not (tmp_path / "new").exists()  # checking creates nothing

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file))
    root, why = cache_dir.usable_cache_root()
    assert root is None and why == (
        f"WORKBENCH_CACHE_DIR={a_file} is a file, not a directory: "
        "point WORKBENCH_CACHE_DIR at a writable directory or set it to off"
    )
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file / "sub"))
    root, why = cache_dir.usable_cache_root()
    assert root is None and f"{a_file} is a file" in why

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache_dir.os, "access", lambda path, mode: False)  # root ignores chmod
    root, why = cache_dir.usable_cache_root()
    assert root is None and f"WORKBENCH_CACHE_DIR={tmp_path} is not writable" in why


def test_a_file_as_cache_dir_makes_the_kernels_unavailable_with_the_reason(tmp_path, monkeypatch, fresh_load):
    a_file = tmp_path / "cache"
    a_file.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file))
    why = cpu_kernels.load()
    assert isinstance(why, str) and f"WORKBENCH_CACHE_DIR={a_file} is a file" in why and "set it to off" in why
    assert cpu_kernels.is_available(torch.device("cpu")) == (False, why)


def test_a_build_is_logged_and_a_load_is_not(tmp_path, monkeypatch, fresh_load, caplog):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    builds = []

    def fake_load(name, build_directory, **kwargs):  # ninja's effect: the library is (re)linked or left
        library = Path(build_directory) / f"{name}.so"
        if not library.exists():
            builds.append(build_directory)
            library.write_bytes(b"built")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level(logging.INFO, logger="workbench"):
        assert cpu_kernels.load() is None
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None
    assert builds == [str(cpu_kernels.build_dir())]
    logged = [
        r for r in caplog.records if r.name == "workbench" and "built the workbench CPU kernels" in r.getMessage()
    ]
    assert len(logged) == 1 and logged[0].levelno >= logging.INFO
    assert str(cpu_kernels.build_dir()) in logged[0].getMessage() and logged[0].getMessage().endswith(" s)")


def test_pipeline_runs_to_the_end_on_reference_ops_with_a_file_as_cache_dir(tmp_path, monkeypatch, fresh_load):
    from workbench import Workbench

    a_file = tmp_path / "cache"
    a_file.write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(a_file))
    wb = Workbench("tiny:llama", device="cpu")
    wb.run()
    assert wb.done
    details = {s.key: s.info.details for s in wb.snapshots if s.info is not None}
    for key in ("fuse_swiglu", "fuse_rmsnorm", "fuse_rope"):
        assert details[key]["backend"] == "torch", (key, details[key])
        assert "is a file, not a directory" in details[key]["why"]
    out = wb.generate([[1, 2, 3]], max_new_tokens=4, stop_token_ids=[])
    assert len(out.token_ids[0]) == 4
    assert a_file.read_text() == ""  # nothing was written through it
