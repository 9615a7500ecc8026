"""Bad input at the edges: each gives a clear error naming the input and what to do, before work is
spent where it can be checked first."""

from __future__ import annotations

import time

import pytest
import torch

from workbench import ConfigError, Workbench
from workbench.cli import main as cli_main
from workbench.models import ModelSpecError, load_model
from workbench.pipeline.config import resolve_pipeline


def test_a_safetensors_file_that_is_not_one_names_the_file(tmp_path):
    from workbench.models import build_tiny_config

    build_tiny_config("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)  # header length ~1.8e19: "header too large"
    with pytest.raises(ModelSpecError, match=r"model\.safetensors is not a valid safetensors file.*Re-download"):
        load_model(str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_on_a_machine_without_cuda_is_refused_before_loading():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"device 'cuda' was asked for, but torch .* cannot use CUDA here.*"
                                         r"use device='cpu'"):
        Workbench("smollm2", device="cuda")  # would take seconds to load if the check came later
    assert time.perf_counter() - t0 < 2
    with pytest.raises(ValueError, match="cannot use CUDA here"):
        load_model("tiny:llama", device="cuda")


def test_an_unwritable_debug_visualize_dir_fails_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "renders"
    # the model spec is invalid too: getting the directory's error proves it was checked first
    with pytest.raises(ValueError, match=r"debug_visualize_dir '.*renders' cannot be written.*pick a directory"):
        Workbench("tiny:no_such_arch", debug_visualize_dir=str(bad))
    assert cli_main(["run", "--model", "tiny:llama", "--debug-visualize-dir", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "cannot be written" in err and "Traceback" not in err


def test_a_malformed_yaml_extra_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "mine.yaml"
    bad.write_text("transforms:\n  fuse_rope:\n    backend: [torch\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: not valid YAML \(line \d+, column \d+\)"):
        resolve_pipeline([str(bad)])
    assert cli_main(["run", "--model", "tiny:llama", "--yaml-extra", str(bad)]) != 0
    assert "mine.yaml: not valid YAML" in capsys.readouterr().err


def test_user_yaml_keys_outside_transforms_are_errors_not_ignored(tmp_path):
    stray = tmp_path / "stray.yaml"
    stray.write_text("fuse_rope:\n  backend: torch\n")  # forgot the 'transforms:' level
    with pytest.raises(ConfigError, match=r"stray\.yaml: unknown top-level key\(s\) 'fuse_rope' \('fuse_rope' is a "
                                          r"transform key: put them under 'transforms:'\); allowed: transforms"):
        resolve_pipeline([str(stray)])
    with pytest.raises(ConfigError, match=r"yaml_extra: unknown top-level key\(s\) 'transform'; allowed: transforms"):
        resolve_pipeline([{"transform": {"fuse_rope": {"backend": "torch"}}}])


def test_with_options_rejects_unknown_options(tiny_llama):
    wb = Workbench(tiny_llama, numerics=False)
    with pytest.raises(TypeError, match=r"with_options: unknown option\(s\) \['max_batch'\]"):
        wb.with_options(max_batch=8)
