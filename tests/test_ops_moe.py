"""Reference semantics of the MoE ops (lists, stacked, dense/BMM), the routing op, and the
Triton routing kernel (on CPU under TRITON_INTERPRET=1 when triton is installed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from triton_child import INTERPRETER_SKIP
import torch.nn.functional as F

import workbench.ops  # noqa: F401
from workbench.ops.moe import triton_moe_routing

wb = torch.ops.workbench
T, H, I, E, K = 6, 8, 5, 4, 2


def _moe_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    weights, selected = torch.topk(logits.softmax(-1), K)
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    return x, selected, weights, w13, w2


def _loop_reference(x, selected, weights, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(selected.shape[1]):
            e = selected[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def test_moe_fused_and_lists_match_a_token_loop():
    x, sel, w, w13, w2 = _moe_inputs()
    ref = _loop_reference(x, sel, w, w13, w2)
    torch.testing.assert_close(wb.torch_moe_fused(x, sel, w, w13, w2), ref, atol=1e-5, rtol=1e-5)
    w1s, w3s, w2s = [w[:I] for w in w13], [w[I:] for w in w13], list(w2)
    torch.testing.assert_close(wb.torch_moe(x, sel, w, w1s, w2s, w3s), ref, atol=1e-5, rtol=1e-5)


def test_moe_dense_forms():
    x, sel, w, w13, w2 = _moe_inputs()
    dense = torch.zeros(T, E).scatter(1, sel, w)
    ref = _loop_reference(x, sel, w, w13, w2)
    out = wb.torch_moe_dense_mlp(x, dense, w13, w2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # Routing on the input: every expert sees x * r[:, e] (Llama-4, top-1).
    on_in = wb.torch_moe_dense_mlp(x, dense, w13, w2, apply_routing_on_input=True)
    ref_in = sum(
        _loop_reference(x * dense[:, e : e + 1], torch.full((T, 1), e), torch.ones(T, 1), w13, w2)
        for e in range(E)
    )
    torch.testing.assert_close(on_in, ref_in, atol=1e-4, rtol=1e-4)


def test_moe_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        wb.torch_moe_fused(*_moe_inputs(), act_fn="swish7")


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_reference(renormalize):
    logits = torch.randn(T, E)
    w, i = wb.torch_moe_topk_softmax(logits, K, renormalize)
    p = logits.softmax(-1)
    rw, ri = torch.topk(p, K)
    if renormalize:
        rw = rw / rw.sum(-1, keepdim=True)
    assert torch.equal(i, ri) and w.dtype == torch.float32
    torch.testing.assert_close(w, rw)


def test_fake_impls_and_opcheck():
    x, sel, w, w13, w2 = _moe_inputs()
    dense = torch.zeros(T, E).scatter(1, sel, w)
    torch.library.opcheck(wb.torch_moe_fused.default, (x, sel, w, w13, w2))
    torch.library.opcheck(
        wb.torch_moe.default, (x, sel, w, [a[:I] for a in w13], list(w2), [a[I:] for a in w13])
    )
    torch.library.opcheck(wb.torch_moe_dense_mlp.default, (x, dense, w13, w2))
    torch.library.opcheck(wb.torch_moe_topk_softmax.default, (torch.randn(T, E), K, True))
    torch.library.opcheck(wb.triton_moe_topk_softmax.default, (torch.randn(T, E), K, True))


def test_triton_op_falls_back_to_torch_where_the_kernel_cannot_run():
    logits = torch.randn(T, E)
    ok, reason = triton_moe_routing.is_available("cpu")
    assert isinstance(reason, str) and reason
    w, i = wb.triton_moe_topk_softmax(logits, K, True)
    rw, ri = wb.torch_moe_topk_softmax(logits, K, True)
    torch.testing.assert_close(w, rw)
    assert torch.equal(i, ri)


_KERNEL_CHECK = """
import torch, workbench.ops
from workbench.ops.moe.triton_moe_routing import is_available, triton_topk_softmax
assert is_available('cpu')[0], is_available('cpu')
for n_exp, k, renorm in [(8, 2, True), (6, 3, False), (128, 8, True), (5, 1, True)]:
    logits = torch.randn(9, n_exp)
    w, i = triton_topk_softmax(logits, k, renorm)
    rw, ri = torch.ops.workbench.torch_moe_topk_softmax(logits, k, renorm)
    torch.testing.assert_close(w, rw)
    assert torch.equal(i, ri), (i, ri)
print('ok')
"""


@pytest.mark.skipif(bool(INTERPRETER_SKIP), reason=INTERPRETER_SKIP)
def test_triton_kernel_under_interpreter_matches_reference():
    # A subprocess: TRITON_INTERPRET must be set before triton is imported.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the compiled Triton kernel")
def test_triton_kernel_on_gpu():
    logits = torch.randn(1000, 64, device="cuda")
    w, i = triton_moe_routing.triton_topk_softmax(logits, 8, True)
    rw, ri = wb.torch_moe_topk_softmax(logits, 8, True)
    torch.testing.assert_close(w, rw)
    assert torch.equal(i, ri)
