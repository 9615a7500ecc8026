"""Backend tables are checked against their family's contract when they are built
(``Backend.contract_problems``, ``workbench/ops/registry.py``): a backend that lacks a required
member is refused at registration, naming what it lacks -- not when a model first picks it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import workbench.ops  # noqa: F401  (registers every op)
from workbench.ops.backends import (
    ATTENTION_BACKENDS, FUSION_BACKENDS, MLA_BACKENDS, AttentionBackend, StateOpBackend, state_backends,
)
from workbench.ops.registry import BackendRegistry, OpBackend
from workbench.ops.state import stateful_ops


def _register(*backends):
    return BackendRegistry("test", backends, default=backends[0].name)


def test_every_shipped_table_meets_its_contract():
    tables = [ATTENTION_BACKENDS, MLA_BACKENDS, *FUSION_BACKENDS.values()]
    tables += [state_backends(op) for op in stateful_ops().values()]
    assert len(tables) >= 3 + 8  # attention, MLA, 3 fusion families, >= 8 stateful ops
    for table in tables:
        for backend in table:
            assert backend.contract_problems() == [], (table.kind, backend.name)


def test_a_backend_without_a_requirement_is_refused():
    with pytest.raises(ValueError, match="'bare' cannot be registered: it lacks a name and a requirement"):
        _register(OpBackend("bare", "", "workbench.ops.attention.torch_cached_attention", "torch_cached_attention"))


def test_an_op_backend_whose_op_is_not_registered_is_refused():
    with pytest.raises(ValueError, match=r"lacks its op workbench::no_such_op"):
        _register(OpBackend("torch", "nothing", "workbench.ops.attention.torch_cached_attention", "no_such_op"))


def test_a_non_reference_backend_without_is_available_is_refused():
    """Only the torch reference runs everywhere; any other backend must say where it runs."""
    with pytest.raises(ValueError, match=r"'fast' cannot be registered: it lacks is_available\(device\)"):
        _register(OpBackend("fast", "a GPU", "workbench.ops.attention.torch_cached_attention", "torch_cached_attention"))


def test_an_attention_backend_with_another_schema_is_refused():
    """Backends are interchangeable in a graph: the op's arguments must be torch_cached_attention's."""
    with pytest.raises(ValueError, match="lacks torch_cached_attention's arguments"):
        _register(AttentionBackend("torch", "nothing", "workbench.ops.mla.torch_cached_mla", "torch_cached_mla"))


def test_an_attention_capture_declaration_must_match_the_op_tags():
    triton = ATTENTION_BACKENDS["triton"]
    with pytest.raises(ValueError, match="captures=False, op tagged cudagraph_unsafe=False"):
        _register(dataclasses.replace(triton, captures=False))
    assert torch.Tag.cudagraph_unsafe in ATTENTION_BACKENDS["torch"].op.tags  # and the reference says so


def test_an_attention_backend_refusing_an_unknown_feature_is_refused():
    flashinfer = ATTENTION_BACKENDS["flashinfer"]
    with pytest.raises(ValueError, match=r"refusals among \['alibi', 'chunked'\] \(got \['sliding'\]\)"):
        _register(dataclasses.replace(flashinfer, refuses={"sliding": "no"}))
    assert flashinfer.unsupported_alibi() and flashinfer.unsupported_chunked()  # declared, not looked up
    assert ATTENTION_BACKENDS["triton"].unsupported_alibi() is None


def test_a_planner_without_begin_is_refused():
    with pytest.raises(ValueError, match="FlashInferPlanner|has no begin"):
        _register(dataclasses.replace(ATTENTION_BACKENDS["flashinfer"], planner=object))


def test_a_state_backend_naming_no_op_is_refused():
    with pytest.raises(ValueError, match="lacks a registered cached op"):
        _register(StateOpBackend("torch", "nothing", "workbench::torch_cached_nothing"))
    with pytest.raises(ValueError, match=r"lacks a backend name among \('torch', 'triton'\)"):
        _register(StateOpBackend("cuda", "a GPU", "workbench::torch_cached_ssm"))


def test_state_ops_choose_like_every_other_table():
    ssm = stateful_ops()["workbench::torch_ssm"]
    table = state_backends(ssm)
    assert table.names() == ("torch", "triton")
    assert table.choose("auto", torch.device("cpu"), "insert_cached_ssm_attention.backend").name == "torch"
    with pytest.raises(RuntimeError, match="'triton' cannot run on cpu.*Pick backend 'torch'"):
        table.choose("triton", torch.device("cpu"), "insert_cached_ssm_attention.backend")
