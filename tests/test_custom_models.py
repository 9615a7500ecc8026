"""The custom-model registry and the factory around it (``workbench/models/custom``, ``load_model``'s
``custom_models``): what is registered and for which HF config class, that no export patch aimed at
an HF class touches a custom model, strict weight sharing and its errors, opting out. The models'
numerics are in ``test_custom_deepseek_v3.py`` / ``test_custom_qwen3_next.py``."""

from __future__ import annotations

import pytest
import torch
from custom_model_support import TINY_REGISTRY

from workbench import Workbench
from workbench.models import ModelSpecError, load_model
from workbench.models.build import build_on_meta
from workbench.models.canonical import MODULE_PATCHES
from workbench.models.custom import CUSTOM_MODELS, DeepseekV3ForCausalLM, Qwen3NextForCausalLM
from workbench.models.custom.loading import CustomModelError, build_export_model, share_tensors


def test_registry_maps_hf_config_classes_and_is_read_only():
    from transformers import DeepseekV3Config, Qwen3NextConfig

    assert dict(CUSTOM_MODELS) == {DeepseekV3Config.__name__: DeepseekV3ForCausalLM,
                                   Qwen3NextConfig.__name__: Qwen3NextForCausalLM}
    with pytest.raises(TypeError):
        CUSTOM_MODELS["LlamaConfig"] = DeepseekV3ForCausalLM  # type: ignore[index]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_no_export_patch_targets_a_custom_model(arch):
    """The canonical export patches pick HF modules by class name (canonical_deepseek_v3_mla,
    canonical_qwen3_next_gated_delta_net): the custom classes are named otherwise, so exporting a custom
    model never swaps any of its forwards. Built on meta: nothing is allocated."""
    config = TINY_REGISTRY[arch]()
    with torch.device("meta"):
        custom = CUSTOM_MODELS[type(config).__name__](config)
    assert {p.name: len(p.targets(custom)) for p in MODULE_PATCHES if p.targets(custom)} == {}
    hf = build_on_meta(config)
    assert any(p.targets(hf) for p in MODULE_PATCHES)  # while HF's own classes are patched


def test_unregistered_architectures_export_their_hf_class(tiny_llama):
    assert tiny_llama.export_model is None and tiny_llama.model_to_export is tiny_llama.model
    snap = Workbench(tiny_llama, numerics=False).step()
    assert snap.info.details["model_class"] == "LlamaForCausalLM (transformers.models.llama.modeling_llama)"


def test_custom_models_argument():
    own = load_model("tiny:qwen3_next", custom_models={})  # an empty registry of one's own
    assert own.export_model is None
    chosen = load_model("tiny:qwen3_next", custom_models={"Qwen3NextConfig": Qwen3NextForCausalLM})
    assert isinstance(chosen.export_model, Qwen3NextForCausalLM)
    with pytest.raises(ModelSpecError, match="custom_models must be True, False or a mapping"):
        load_model("tiny:qwen3_next", custom_models="yes")


def test_weights_must_load_unchanged():
    """Strict sharing: a custom model whose modules do not line up with the HF state dict is an error that
    names the keys and the way out, never a silently random weight."""
    config = TINY_REGISTRY["deepseek_v3"]()
    hf = build_on_meta(config)
    other = TINY_REGISTRY["deepseek_v3"]()
    other.first_k_dense_replace = 2  # layer 1 dense in the custom model, MoE in the HF one
    with torch.device("meta"):
        custom = DeepseekV3ForCausalLM(other)
    with pytest.raises(CustomModelError, match=r"(?s)does not load into custom DeepseekV3ForCausalLM unchanged.*"
                                               r"layers\.1\.mlp.*custom_models=False"):
        share_tensors(hf, custom)
    assert isinstance(build_export_model(hf), DeepseekV3ForCausalLM)  # the matching config shares fine (on meta)


def test_unsupported_config_names_the_way_out():
    def gelu_v3():
        config = TINY_REGISTRY["deepseek_v3"]()
        config.hidden_act = "gelu"
        return config

    registry = {**TINY_REGISTRY, "gelu_v3": gelu_v3}
    # the default registry falls back to HF's class, saying why (test_custom_deepseek_v3 runs it end to end);
    # a custom model asked for by name refuses
    loaded = load_model("tiny:gelu_v3", tiny_registry=registry)
    assert loaded.export_model is None and "hidden_act='gelu'" in loaded.custom_fallback
    with pytest.raises(ModelSpecError, match=r"hidden_act='gelu'.*custom_models=False"):
        load_model("tiny:gelu_v3", tiny_registry=registry, custom_models={"DeepseekV3Config": DeepseekV3ForCausalLM})
    assert load_model("tiny:gelu_v3", tiny_registry=registry, custom_models=False).export_model is None

    config = TINY_REGISTRY["qwen3_next"]()
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(NotImplementedError, match="rescales with the sequence length"):
        Qwen3NextForCausalLM(config)
