"""``workbench::cpu_linear_wxt``: a linear layer computed as ``(W @ x.T).T`` -- the CPU decode GEMM.

``aten.linear`` on a CPU hands MKL ``x [M, K] @ W.T`` with ``W [N, K]`` row-major. For the small
M of decode steps MKL's sgemm streams ``W`` much faster when asked for the transposed product
``W @ x.T -> [N, M]`` (a tall-skinny GEMM that reads each weight row once), except at M = 1, where
it drops into a slow GEMV path; so a single row is padded to two. ``bench/linear_orientation.py``
(the project's 2-core x86 machine, fp32, cold weights: all of SmolLM2's linear shapes over 30
layers + the 49,152 x 576 LM head, ms per pass, best of 5, this op including its copy-back)::

    M          aten.linear (W [N,K])   x @ W_kn (K-major copy)   this op (W as loaded)
    1          45.1                    30.1                      18.1
    8          55.5                    64.6                      43.1
    32         89.4                    97.4                      87.5

so it also needs no transposed weight copy (``linear_weight_layout: kn`` costs one for a tied LM
head). The ``[N, M]`` product is copied back to a contiguous ``[..., N]`` (cheap next to the GEMM,
and what compilers expect of an op's output); above 64 rows (prefill) it is plain ``F.linear``.
Same maths as ``F.linear``; the fp32 summation order of the GEMM differs, as any kernel's does.

``torch-compile`` inlines it (``workbench.ops.inline``): Inductor then fuses the copy-back into the
next element-wise kernel; its row-count branches become guards (one graph for a single-row decode,
one for 2-64 rows, one above). Registered through ``define_op`` (not ``custom_op``): 211 calls per SmolLM2 decode step make the
Python-side dispatch of ``custom_op`` (~16 us a call) a measurable share of the step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..library import define_op

# Above this many rows (prefill) both orientations are large GEMMs; aten.linear skips the transpose copy.
MAX_ROWS = 64


def linear_wxt(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``input @ weight.T + bias`` as ``(weight @ input.T).T``: input [..., K], weight [N, K] -> [..., N]
    (contiguous)."""
    rows = input.reshape(-1, input.shape[-1])  # [M, K]
    m = rows.shape[0]
    if m > MAX_ROWS:
        return torch.nn.functional.linear(input, weight, bias)
    if m == 1:  # MKL runs [N, K] @ [K, 1] as a slow GEMV; [K, 2] takes the fast GEMM path
        rows = torch.cat([rows, rows])
    out = torch.mm(weight, rows.t())[:, :m].t()  # [M, N], a transposed view of [N, M']
    out = out.contiguous()  # (x + bias would keep the transposed strides)
    if bias is not None:
        out.add_(bias)
    return out.reshape(*input.shape[:-1], weight.shape[0])


def _cpu_linear_wxt_fake(input, weight, bias=None):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


cpu_linear_wxt = define_op(
    "cpu_linear_wxt(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    linear_wxt,
    _cpu_linear_wxt_fake,
    category="matmul",
    reference=linear_wxt,
)

__all__ = ["linear_wxt", "cpu_linear_wxt"]
