"""``linear_weight_layout`` (stage ``post_load_fusion``): how CPU linears read their weights.

A decode step is a chain of small-M GEMMs (``x [M, K] @ W.T``, ``W [N, K]``, M = sequences in the
step). ``aten.linear`` hands MKL that product as is, and MKL streams the row-major weight slowly
for small M. Two rewrites, chosen by ``layout``:

* ``wxt``: ``cpu_linear_wxt(x, W, b)`` computes
  ``(W @ x.T).T`` on the weights as loaded -- the orientation in which MKL streams a row-major
  weight fastest at every decode batch size (one row padded to two; ``workbench/ops/mlp/
  cpu_linear_wxt.py`` has the measurements). Nothing is copied. SmolLM2 decode on this project's
  2-core machine, ``torch-compile``: 26.2 -> 35.6 tok/s at batch 1, 92 -> 134 at batch 8 against ``kn``.
* ``kn``: ``matmul(x, W_kn) (+ b)`` with ``W_kn = W.t().contiguous() [K, N]`` transposed once, here,
  for every linear (MKL's GEMV reads a K-major copy faster than the row-major weight when the
  output is at least as wide as the input: GB/s row-major -> K-major, SmolLM2 shapes N x K:
  960 x 576 11.3 -> 16.7, 3072 x 576 11.3 -> 20.2, 49152 x 576 11.5 -> 25.1, but 576 x 1536
  15.9 -> 12.1; it was the CPU default before ``wxt``). The transposed weight is a new parameter beside the original (``<name>_kn``); the
  original is dropped when nothing else reads it, so memory moves by ``new_bytes - freed_bytes``
  (a tied LM head keeps its embedding table: one extra copy).

* ``kernel``: fp32 linears -> ``cpu_linear``, canonical ``torch_int4_linear`` / ``torch_int8_linear`` ->
  ``cpu_int4_linear`` / ``cpu_int8_linear`` (``workbench/ops/cpu_kernels``, this CPU's AVX-512, AVX2 or NEON
  build): one pass over the weights as loaded per 8 rows of input (up to 16 rows; larger inputs go to BLAS). Nothing is
  copied. Quantized linears are rewritten under every layout except ``nk``, which keeps the
  reference ops (dequantize, then ``F.linear``) -- the ground truth the numerics compare against.

``auto`` on CPU takes what this CPU measured fastest (``workbench/ops/cpu_kernels/calibrate.py``: a
short calibration once per machine and kernel build, cached): for fp32 linears ``kernel``, ``wxt``
or ``nk``; quantized linears go to the C++ kernels where they load, with the int4 activations the
calibration picked (``int4_activations: auto``: int8 only where it measured at least 10 % faster).
Where the kernels do not load (no variant for this CPU, no compiler, ``WORKBENCH_CPU_ISA=none``) the
quantized weights are dequantized once, here, to fp32 linears (the reference op would dequantize
them on every call), and the fp32 choice applies to them too. On CUDA cuBLAS reads either layout at
full speed, so ``layout: auto`` leaves the graph alone there.
"""

from __future__ import annotations

from typing import Any, Dict, Literal, Tuple

import torch
import torch.fx as fx
from pydantic import Field

from ...context import PipelineContext
from ...graph.weights import fake_value, fetch_attr, release_weights
from ...interface import Transform, TransformConfig, TransformInfo, register
from .linear_rewrites import (
    dequantize_once,
    fp32_linear_weights,
    int4_linears,
    rewrite_linears,
    to_kernels,
    to_quantized_kernels,
    to_wxt,
)

aten = torch.ops.aten


class LinearWeightLayoutConfig(TransformConfig):
    layout: Literal["auto", "nk", "kn", "wxt", "kernel"] = Field(
        default="auto",
        description="How linears read their weights: 'nk' (aten.linear on the weight as "
        "loaded, [out, in]), 'kn' (matmul on a transposed copy [in, out]), 'wxt' (the weight as loaded, "
        "computed as (W @ x.T).T by workbench.cpu_linear_wxt), 'kernel' (the workbench's C++ CPU kernels, "
        "fp32 and int4/int8), 'auto' (on CPU what this CPU measured fastest, cached per machine and kernel "
        "build: the C++ kernels for quantized weights where they load, else the weights dequantized once; "
        "kernel, wxt or nk for fp32 ones; nk on other devices).",
    )
    int4_activations: Literal["auto", "fp32", "int8"] = Field(
        default="auto",
        description="What the int4 CPU kernel multiplies the 4-bit weights with in decode "
        "steps (<= 16 rows): 'fp32' (the activations as they are: equal to the reference op up to summation "
        "order), 'int8' (activations rounded to 8 bits per block of 32, scale max|x|/127, and integer "
        "dot products, as llama.cpp does for Q4 weights: a numerics change; AVX512-VNNI, AVX2 or NEON byte "
        "dot products) or 'auto' (int8 where this CPU measured it at least 10 % faster than fp32, else fp32; "
        "the details say which and the times). Prefill inputs are always exact.",
    )
    expect_mem_change: bool = Field(
        default=True, description="Transposed copies replace (or, when tied, add to) the weights."
    )


def transposed_weight(gm: fx.GraphModule, target: str) -> Tuple[str, int]:
    """Register ``<target>_kn = W.t().contiguous()`` beside ``target``; returns (target, bytes)."""
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    w = fetch_attr(gm, target)
    new_name, i = f"{name}_kn", 1
    while hasattr(owner, new_name):
        new_name, i = f"{name}_kn{i}", i + 1
    with torch.no_grad():
        kn = w.detach().t().contiguous()
    owner.register_parameter(new_name, torch.nn.Parameter(kn, requires_grad=False))
    return (f"{owner_path}.{new_name}" if owner_path else new_name), kn.numel() * kn.element_size()


@register("linear_weight_layout")
class LinearWeightLayout(Transform[LinearWeightLayoutConfig]):
    """``linear(x, W, b)`` -> ``cpu_linear_wxt(x, W, b)`` (``wxt``) or ``matmul(x, W.T contiguous) + b``
    (``kn``); see the module docstring."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        from ....ops import cpu_kernels
        from ....ops.cpu_kernels import calibrate

        device = torch.device(ctx.device)
        layout: str = self.config.layout
        act: str = self.config.int4_activations
        auto = layout == "auto"
        if (auto and device.type != "cpu") or layout == "nk":  # nk: the reference ops stay (the ground truth)
            return gm, TransformInfo(num_matches=0, details={"layout": "nk (weights left as loaded)"})
        kernels = device.type == "cpu" and cpu_kernels.is_available(device)[0]
        notes: Dict[str, Any] = {}
        summary = []  # one line for the run's summary (Workbench.backends_line)
        if kernels:
            if act == "auto" and ctx.dist.world_size > 1:
                # Each rank would calibrate on its own (one thread, its own shard, its own noise) and
                # could pick the other rounding: int8 rounding on one rank reaches every rank's logits
                # through the all-reduce, which the cache check of a rank that chose exact does not
                # expect. Sharded runs take the exact activations on every rank.
                act = "fp32"
                notes["int4_activations_auto"] = "fp32 (sharded: every rank the same numerics, not calibrated)"
            elif act == "auto":
                measured = calibrate.int4_activation_choice(int4_linears(gm)) if int4_linears(gm) else None
                act = measured.choice if measured is not None else "fp32"
                if measured is not None:
                    notes["int4_activations_auto"] = measured.why()
            quantized = to_quantized_kernels(gm, device, act)
            if quantized:
                notes["int4_activations"] = "fp32" if act == "fp32" else f"int8 ({cpu_kernels.int8_dot()})"
                how = (
                    f" [auto, {notes['int4_activations_auto'].split(' (', 1)[1][:-1]}]"
                    if "int4_activations_auto" in notes
                    else ""
                )
                exact = "exact fp32 activations" if act == "fp32" else "int8 activations"
                summary.append(f"{quantized} quantized on the C++ kernels, {exact}{how}")
        elif auto and device.type == "cpu":  # no C++ kernels here: the quantized weights once to fp32, not per call
            quantized, nbytes = dequantize_once(gm)
            if quantized:
                notes["dequantized"] = (
                    f"{quantized} quantized linears dequantized once to fp32 linears (+{nbytes / 2**20:.1f} MiB): "
                    f"no C++ kernels here ({cpu_kernels.load()})"
                )
                summary.append(f"{quantized} quantized dequantized once to fp32 (+{nbytes / 2**20:.0f} MiB)")
        else:
            quantized = 0
        if auto:
            weights = fp32_linear_weights(gm)
            # every rank of a sharded run takes rank 0's choice (DistInfo.agree)
            measured = ctx.dist.agree(calibrate.fp32_linear_choice(weights)) if weights else None
            layout = measured.choice if measured is not None else "nk"
            if measured is not None:
                notes["auto"] = f"fp32 linears: {measured.why()}"
                summary.append(f"{len(weights)} fp32 as {layout} [auto, {measured.evidence()}]")
        if summary:
            notes["summary"] = "; ".join(summary)
        if layout in ("kernel", "wxt", "nk"):
            if layout == "kernel":
                gm, info = to_kernels(gm, device)
            elif layout == "wxt":
                gm, info = to_wxt(gm, fp32_only=auto)
            else:  # auto measured aten.linear fastest for fp32 weights (or there are none): they stay
                info = TransformInfo(
                    num_matches=0,
                    is_clean=True,
                    has_valid_shapes=True,
                    details={"layout": "nk (weights left as loaded)"},
                )
            # the quantized linears were retargeted or rewritten with their values: shapes stay valid
            info.num_matches += quantized
            info.is_clean = info.is_clean and not quantized
            info.details.update(notes)
            return gm, info
        done: Dict[str, str] = {}  # original weight target -> transposed target (shared weights once)
        new_bytes = 0

        def matmul_kn(g: fx.Graph, node: fx.Node, bias: Any) -> fx.Node:
            nonlocal new_bytes
            target = node.args[1].target
            if target not in done:
                done[target], nbytes = transposed_weight(gm, target)
                new_bytes += nbytes
            w_kn = g.get_attr(done[target])
            w_kn.meta["val"] = fake_value(gm, fetch_attr(gm, done[target]))
            out = g.call_function(aten.matmul.default, (node.args[0], w_kn))
            return g.call_function(aten.add.Tensor, (out, bias)) if bias is not None else out

        rewritten = rewrite_linears(gm, matmul_kn) + quantized
        released = release_weights(gm, list(done))
        details = {
            **notes,
            "layout": layout,
            "weights": len(done),
            "new_bytes": new_bytes,
            "freed_bytes": released.freed_bytes,
            "kept_originals": released.kept + released.tied,
        }
        return gm, TransformInfo(
            num_matches=rewritten, is_clean=not rewritten, has_valid_shapes=not rewritten, details=details
        )


__all__ = ["LinearWeightLayout", "LinearWeightLayoutConfig", "transposed_weight"]
