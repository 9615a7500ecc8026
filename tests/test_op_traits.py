"""Op traits are declared where an op is defined (``OpTraits``, ``workbench/ops/library.py``) and
read from there by the passes: the cost model's category, the norm kind (sharding, multi-stream),
the inlinable reference (compile stage), capture safety (the op's tag), activation rounding (the
cache check). A new op -- here a test RMSNorm -- is seen by every pass from its definition alone."""

from __future__ import annotations

import pytest
import torch

import workbench.ops  # noqa: F401  (defines every op)
from workbench.analysis.cost.categories import category_of
from workbench.ops.inline import inline_table
from workbench.ops.library import CATEGORIES, OpTraits, activation_rounding, op_traits, ops_with, workbench_op
from workbench.pipeline.transforms.compile.multi_stream import rms_norm_ops

wb = torch.ops.workbench


def _all_ops():
    """Every workbench op a graph can hold: those returning tensors (the C++ kernels' library also
    defines ``cpu_kernels_isa() -> str``, a query of the loaded build that no graph calls)."""
    names = (n for n in dir(wb) if not n.startswith("_") and hasattr(getattr(wb, n), "default"))
    return sorted(n for n in names if any("Tensor" in str(r.type) for r in getattr(wb, n).default._schema.returns))


@workbench_op("test_traits_rmsnorm", category="norm", norm="rms")
def _test_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@_test_rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def test_every_op_declares_its_traits():
    missing = [n for n in _all_ops() if op_traits(n) is None]
    assert missing == [] and len(_all_ops()) >= 80
    assert {op_traits(n).category for n in _all_ops()} <= set(CATEGORIES)


def test_traits_are_found_from_a_name_a_packet_an_overload_and_a_node():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(wb.torch_rmsnorm.default, (x, x, 1e-6))
    for ref in ("torch_rmsnorm", wb.torch_rmsnorm, wb.torch_rmsnorm.default, node):
        assert op_traits(ref).norm == "rms", ref
    assert op_traits(torch.ops.aten.add.Tensor) is None and op_traits(x) is None


def test_norm_kinds_at_the_op():
    assert set(ops_with(lambda t: t.norm == "rms")) == {
        "torch_rmsnorm", "triton_rmsnorm", "flashinfer_rmsnorm", "cpu_rmsnorm", "test_traits_rmsnorm"}
    assert set(ops_with(lambda t: t.norm == "l2")) == {"torch_l2norm"}


def test_a_new_norm_is_seen_by_every_pass_from_its_definition():
    assert "test_traits_rmsnorm" in rms_norm_ops()  # multi-stream keeps it on the main stream
    assert category_of("workbench", "test_traits_rmsnorm") == "norm"  # the cost model's row
    x = torch.randn(2, 8)
    torch.testing.assert_close(_test_rmsnorm(x, torch.ones(8), 1e-6), wb.torch_rmsnorm(x, torch.ones(8), 1e-6))


def test_inlining_reads_the_declared_references():
    names = {op._schema.name.split("::")[1] for op in inline_table()}
    assert names == {"torch_rmsnorm", "torch_silu_and_mul", "torch_rope_with_explicit_cos_sin", "cpu_linear_wxt"}


def test_capture_safety_is_the_op_tag():
    for name in _all_ops():
        tagged = torch.Tag.cudagraph_unsafe in getattr(wb, name).default.tags
        assert tagged == (not op_traits(name).capture_safe), name


def test_activation_rounding_is_declared_by_the_quantizing_ops():
    assert activation_rounding("torch_fp8_linear") == 2**-3 and activation_rounding("torch_nvfp4_linear") == 2**-1
    assert activation_rounding("cpu_int4_linear_a8") == 2**-7
    assert activation_rounding("torch_rmsnorm") is None


def test_bad_traits_and_a_second_definition_are_refused():
    with pytest.raises(ValueError, match="op category 'fancy' is not one of"):
        OpTraits("fancy")
    with pytest.raises(ValueError, match="norm kind 'layer' is not one of"):
        OpTraits("norm", norm="layer")
    def again(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="workbench::test_traits_rmsnorm is defined twice"):
        workbench_op("test_traits_rmsnorm", category="norm")(again)
