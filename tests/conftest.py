"""Shared fixtures: models are loaded once per session and never mutated by tests."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    from workbench.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def tiny_llama():
    from workbench.models import load_model

    return load_model("tiny:llama")
