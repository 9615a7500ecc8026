"""An HF directory whose config.json disagrees with its weights fails with an ``InputError`` naming
config.json, the weights file, the first differing tensor with both shapes, and what to do.

It used to end in transformers' "You set `ignore_mismatched_sizes` to `False`, thus raising an
error. For details look at the above report!" for a wrong size -- and a wrong layer count loaded
without any error: an extra layer randomly initialised, or a layer of the weights dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from workbench import Workbench
from workbench.errors import InputError
from workbench.models import load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """tiny:llama (2 layers, hidden 64, intermediate 128) as save_pretrained writes it."""
    out = tmp_path_factory.mktemp("tiny_llama")
    load_model("tiny:llama", device="cpu").model.save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    return out


def _edited(saved: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "model"
    shutil.copytree(saved, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _error(directory: Path) -> str:
    with pytest.raises(InputError) as err:
        load_model(str(directory), device="cpu")
    msg = str(err.value)
    assert "config.json disagrees with the weights (model.safetensors)" in msg
    assert "Use the config.json that was saved with these weights" in msg
    assert "ignore_mismatched_sizes" not in msg
    return msg


def test_the_untouched_directory_loads_the_same_weights(saved):
    ref = load_model("tiny:llama", device="cpu").model.state_dict()
    got = load_model(str(saved), device="cpu").model.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_wrong_intermediate_size_names_the_tensor_both_shapes_and_the_value(saved, tmp_path):
    msg = _error(_edited(saved, tmp_path, intermediate_size=256))
    assert "model.layers.0.mlp.gate_proj.weight is [128, 64] in model.safetensors, but [256, 64]" in msg
    assert "config.json has intermediate_size=256" in msg
    assert "5 more tensors differ" in msg  # gate, up, down of 2 layers


def test_a_wrong_hidden_size_names_the_first_tensor(saved, tmp_path):
    msg = _error(_edited(saved, tmp_path, hidden_size=128))
    assert "model.embed_tokens.weight is [512, 64] in model.safetensors, but [512, 128]" in msg
    assert "hidden_size=128" in msg


def test_more_layers_than_the_weights_hold_is_not_loaded_with_random_ones(saved, tmp_path):
    msg = _error(_edited(saved, tmp_path, num_hidden_layers=3))
    assert "9 tensors that are not in the weights, first model.layers.2." in msg
    assert "the weights hold 2 layers, config.json says num_hidden_layers=3" in msg


def test_fewer_layers_than_the_weights_hold_drops_none_silently(saved, tmp_path):
    msg = _error(_edited(saved, tmp_path, num_hidden_layers=1))
    assert "the weights hold 9 tensors that the model config.json describes has no place for" in msg
    assert "first model.layers.1.input_layernorm.weight [64] in model.safetensors" in msg
    assert "config.json says num_hidden_layers=1" in msg


def test_workbench_reports_it_before_any_pipeline(saved, tmp_path):
    with pytest.raises(InputError, match=r"intermediate_size=256"):
        Workbench(str(_edited(saved, tmp_path, intermediate_size=256)), device="cpu")
