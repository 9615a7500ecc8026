"""The typed contracts between transforms and the registries the families choose backends from:
facts compared by identity and checked by the framework, every backend op registered by importing
``workbench.ops``, one ``choose`` for every backend table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from workbench.ops.backends import ATTENTION_BACKENDS, FUSION_BACKENDS
from workbench.pipeline.context import CACHE_SPECS, HF_ATTENTION_LAYERS, Fact, PipelineContext, PipelineOrderError
from workbench.pipeline.interface import Transform, TransformInfo, TransformError, TransformRegistry, check_order
from workbench.runtime.interface import COMPILE_BACKENDS


def test_importing_ops_registers_every_backend_op():
    """In a fresh process (this one has imported the backend modules already): every op a backend
    table names exists right after ``import workbench.ops``, before any table loads its module."""
    code = ("import torch, workbench.ops\n"
            "from workbench.ops.backends import ATTENTION_BACKENDS, FUSION_BACKENDS\n"
            "names = [b.op_name for b in ATTENTION_BACKENDS] + [b.op_name for t in FUSION_BACKENDS.values() for b in t]\n"
            "print([n for n in names if not hasattr(torch.ops.workbench, n)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_table_chooses_the_same_way():
    cpu = torch.device("cpu")
    for table in (ATTENTION_BACKENDS, *FUSION_BACKENDS.values(), COMPILE_BACKENDS):
        choice = table.choose("auto", cpu, "x.backend")
        assert choice.backend.unavailable_reason(cpu) is None and choice.why.startswith("auto on cpu: ")
        assert table.choose("torch" if "torch" in table else "torch-simple", cpu, "x.backend").why.endswith("(requested)")
    refused = ATTENTION_BACKENDS.choose("auto", cpu, "x", refuse=lambda b: "no" if b.name == "cpu" else None)
    assert refused.name == "torch" and "passed over: cpu: no" in refused.why
    with pytest.raises(ValueError, match="attention backend 'torch' does not support this model: too big. "
                                         "No other attention backend"):
        ATTENTION_BACKENDS.choose("torch", cpu, "x", refuse=lambda b: "too big")


class _Leaves(Transform):
    provides = (CACHE_SPECS,)

    def _apply(self, gm, ctx):
        return gm, TransformInfo(num_matches=1)  # says it changed the graph, declares no specs


class _NeedsLayers(Transform):
    needs = (HF_ATTENTION_LAYERS,)

    def _apply(self, gm, ctx):
        return gm, TransformInfo(num_matches=0)


def _run(cls, ctx=None):
    from workbench.pipeline.interface import GraphState, TransformConfig

    reg = TransformRegistry()
    reg.register(cls.__name__.lower())(cls)
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    return cls(TransformConfig(stage="cache_init"))(gm, ctx or PipelineContext.standalone(), GraphState())


def test_the_framework_checks_what_a_transform_provides_and_needs():
    with pytest.raises(TransformError, match="left no cache specs in the context, which it provides"):
        _run(_Leaves)
    with pytest.raises(TransformError, match="needs the attention layers") as e:
        _run(_NeedsLayers)
    assert isinstance(e.value.__cause__, PipelineOrderError)


def test_order_is_checked_by_fact_identity_not_by_name():
    from workbench.pipeline.config import PipelineEntry
    from workbench.pipeline.interface import TransformConfig

    lookalike = Fact("cache specs", lambda ctx: True)  # same name, another fact

    class Provides(Transform):
        provides = (lookalike,)

    class Needs(Transform):
        needs = (CACHE_SPECS,)

    class ProvidesSpecs(Transform):
        provides = (CACHE_SPECS,)

    reg = TransformRegistry()
    for cls in (Provides, Needs, ProvidesSpecs):
        reg.register(cls.__name__.lower())(cls)
    cfg = TransformConfig(stage="cache_init")
    assert check_order([PipelineEntry("needs", cfg), PipelineEntry("provides", cfg)], reg) is None
    msg = check_order([PipelineEntry("needs", cfg), PipelineEntry("providesspecs", cfg)], reg)
    assert msg is not None and "needs the cache specs that providesspecs provides" in msg
