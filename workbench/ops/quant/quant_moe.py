"""Quantized mixture-of-experts ops: ``torch_moe_fused`` with FP8, fine-grained FP8, NVFP4 or MXFP4 experts.

Same routing arguments and stacked layout as ``torch_moe_fused`` (``moe/torch_moe.py``, whose
routing/combine loop they reuse): x [..., H], selected_experts / routing_weights [T, k],
w1_w3 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; each expert computes
``down(act(gate(x)) * up(x))`` (``moe/expert_mlp.py``; MXFP4 also takes gpt-oss's biases,
interleaved gate/up rows and clamped SwiGLU, as ``torch_moe_fused`` does; the others refuse
``clamped_swiglu`` by name). Per expert, activations are quantized the way that format's GEMMs
consume them (FP8: static per-tensor scales; fine-grained FP8: dynamic 1 x 128 groups; NVFP4:
dynamic 16-blocks under a static global scale; MXFP4: not at all, weight-only), the weights are
dequantized with the codecs, and the products run in fp32. Output: x's dtype.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..library import define_op
from ..moe.expert_mlp import SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation, expert_mlp
from ..moe.torch_moe import MOE_HOST_SYNC, _act, _combine
from .codecs import FP4_E2M1_STEP, FP8_E4M3_STEP, fp8_block_dequantize, mxfp4_dequantize, nvfp4_dequantize
from .fp8 import fp8_group_qdq, fp8_qdq
from .nvfp4 import NVFP4_BLOCK, nvfp4_qdq

MXFP4_BLOCK = 32


def _gated(
    act_fn: str,
    x: torch.Tensor,
    w1_w3: torch.Tensor,
    w2: torch.Tensor,
    quantize_x: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.float(),
    quantize_h: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    **options,
) -> torch.Tensor:
    """One expert on its tokens: fp32 ``w2 @ gated(w1_w3 @ x)`` from dequantized fp32 weights;
    ``options``: biases / layout / SwiGLU parameters of ``expert_mlp``."""
    return expert_mlp(quantize_x(x), w1_w3, w2, act_fn, quantize_h=quantize_h, **options)


def _static_scaled_moe(
    x: torch.Tensor,
    selected_experts: torch.Tensor,
    routing_weights: torch.Tensor,
    act_fn: str,
    dequantize: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
    qdq: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    w1_w3_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """The MoE of a format whose GEMMs take static per-tensor activation scales (FP8, NVFP4): expert
    e's fp32 (w1_w3, w2) are ``dequantize(e)``; its gate/up input is rounded by ``qdq`` with
    ``w1_w3_input_scale[e]``, its down projection's input with ``w2_input_scale[e]``."""
    _act(act_fn)  # act(gate) * up only: clamped_swiglu is refused by name

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        w13, w2e = dequantize(e)
        return _gated(act_fn, xe, w13, w2e, lambda t: qdq(t, w1_w3_input_scale[e]), lambda t: qdq(t, w2_input_scale[e]))

    return _combine(x, selected_experts, routing_weights, expert)


def _moe_fake(x, *args, **kwargs):
    return torch.empty_like(x)


def _define_moe_op(schema: str, impl: Callable, activation_rounding: Optional[float] = None):
    """``define_op`` with what every quantized MoE op shares: the fake (x's shape and dtype), the host
    sync of the per-expert loop, the category; ``activation_rounding``: the grid the format rounds x
    to (None: weight-only)."""
    return define_op(
        schema, impl, _moe_fake, host_sync=MOE_HOST_SYNC, activation_rounding=activation_rounding, category="moe"
    )


# --------------------------------------------------------------------------------------------- FP8
def fp8_moe(
    x,
    selected_experts,
    routing_weights,
    w1_w3,
    w2,
    w1_w3_input_scale,
    w2_input_scale,
    w1_w3_weight_scale,
    w2_weight_scale,
    act_fn="silu",
):
    def dequantize(e: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return w1_w3[e].float() * w1_w3_weight_scale[e].float(), w2[e].float() * w2_weight_scale[e].float()

    return _static_scaled_moe(
        x, selected_experts, routing_weights, act_fn, dequantize, fp8_qdq, w1_w3_input_scale, w2_input_scale
    )


torch_fp8_moe = _define_moe_op(
    "torch_fp8_moe(Tensor x, Tensor selected_experts, Tensor routing_weights, Tensor w1_w3, Tensor w2, "
    "Tensor w1_w3_input_scale, Tensor w2_input_scale, Tensor w1_w3_weight_scale, Tensor w2_weight_scale, "
    'str act_fn="silu") -> Tensor',
    fp8_moe,
    FP8_E4M3_STEP,
)


# ------------------------------------------------------------------------------- fine-grained FP8
def dequantize_gate_up_blocks(w1_w3: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """One expert's stacked [2I, H] fp8 gate/up weight -> fp32.

    Accepts the scales tiled over the stacked rows ([ceil(2I/bn), ...]) or gate and up each tiled
    on its own and stacked ([2 * ceil(I/bn), ...], what stacking two HF ``weight_scale_inv`` gives);
    the two differ when I is not a multiple of bn."""
    rows = w1_w3.shape[0]
    if scale_inv.shape[0] == -(-rows // block_n):
        return fp8_block_dequantize(w1_w3, scale_inv, (block_n, block_k))
    half_tiles = -(-(rows // 2) // block_n)
    if rows % 2 == 0 and scale_inv.shape[0] == 2 * half_tiles:
        gate, up = w1_w3.chunk(2, dim=0)
        return torch.cat(
            [
                fp8_block_dequantize(gate, scale_inv[:half_tiles], (block_n, block_k)),
                fp8_block_dequantize(up, scale_inv[half_tiles:], (block_n, block_k)),
            ]
        )
    raise ValueError(
        f"torch_finegrained_fp8_moe: w1_w3 rows {rows} with block_n {block_n} need "
        f"{-(-rows // block_n)} (stacked) or {2 * half_tiles} (gate and up apart) scale rows, "
        f"got weight_scale_inv of shape {tuple(scale_inv.shape)}"
    )


def finegrained_fp8_moe(
    x,
    selected_experts,
    routing_weights,
    w1_w3,
    w2,
    w1_w3_weight_scale_inv,
    w2_weight_scale_inv,
    act_fn="silu",
    block_n=128,
    block_k=128,
):
    _act(act_fn)  # act(gate) * up only: clamped_swiglu is refused by name

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        w13 = dequantize_gate_up_blocks(w1_w3[e], w1_w3_weight_scale_inv[e], block_n, block_k)
        w2e = fp8_block_dequantize(w2[e], w2_weight_scale_inv[e], (block_n, block_k))
        return _gated(act_fn, xe, w13, w2e, lambda t: fp8_group_qdq(t, block_k), lambda t: fp8_group_qdq(t, block_k))

    return _combine(x, selected_experts, routing_weights, expert)


torch_finegrained_fp8_moe = _define_moe_op(
    "torch_finegrained_fp8_moe(Tensor x, Tensor selected_experts, Tensor routing_weights, Tensor w1_w3, "
    'Tensor w2, Tensor w1_w3_weight_scale_inv, Tensor w2_weight_scale_inv, str act_fn="silu", '
    "int block_n=128, int block_k=128) -> Tensor",
    finegrained_fp8_moe,
    FP8_E4M3_STEP,
)


# ------------------------------------------------------------------------------------------ NVFP4
def nvfp4_moe(
    x,
    selected_experts,
    routing_weights,
    w1_w3,
    w2,
    w1_w3_weight_scale,
    w2_weight_scale,
    w1_w3_weight_scale_2,
    w2_weight_scale_2,
    w1_w3_input_scale,
    w2_input_scale,
    act_fn="silu",
):
    def dequantize(e: int) -> Tuple[torch.Tensor, torch.Tensor]:
        w13 = nvfp4_dequantize(w1_w3[e], w1_w3_weight_scale[e], w1_w3_weight_scale_2[e], NVFP4_BLOCK)
        return w13, nvfp4_dequantize(w2[e], w2_weight_scale[e], w2_weight_scale_2[e], NVFP4_BLOCK)

    return _static_scaled_moe(
        x, selected_experts, routing_weights, act_fn, dequantize, nvfp4_qdq, w1_w3_input_scale, w2_input_scale
    )


torch_nvfp4_moe = _define_moe_op(
    "torch_nvfp4_moe(Tensor x, Tensor selected_experts, Tensor routing_weights, Tensor w1_w3, Tensor w2, "
    "Tensor w1_w3_weight_scale, Tensor w2_weight_scale, Tensor w1_w3_weight_scale_2, Tensor w2_weight_scale_2, "
    'Tensor w1_w3_input_scale, Tensor w2_input_scale, str act_fn="silu") -> Tensor',
    nvfp4_moe,
    FP4_E2M1_STEP,
)


# ------------------------------------------------------------------------------------------ MXFP4
def mxfp4_moe(
    x,
    selected_experts,
    routing_weights,
    w1_w3_blocks,
    w1_w3_scales,
    w1_w3_bias: Optional[torch.Tensor],
    w2_blocks,
    w2_scales,
    w2_bias: Optional[torch.Tensor],
    act_fn="silu",
    gate_up_interleaved=False,
    swiglu_alpha=SWIGLU_ALPHA,
    swiglu_limit=SWIGLU_LIMIT,
):
    """Weight-only: activations stay unquantized (upcast to fp32 for the products).

    ``w1_w3_blocks`` [E, 2I, H/2] / ``w1_w3_scales`` [E, 2I, H/32] in the stored row order (gpt-oss:
    gate and up rows alternate, ``gate_up_interleaved``); biases [E, 2I] / [E, H] as stored (bf16 in
    gpt-oss checkpoints, added in fp32); ``act_fn`` as ``torch_moe_fused`` takes it."""
    check_activation(act_fn)
    if w1_w3_scales.dtype != torch.uint8 or w2_scales.dtype != torch.uint8:
        raise TypeError(
            f"torch_mxfp4_moe: MXFP4 scales are uint8 e8m0 exponents, got {w1_w3_scales.dtype} and {w2_scales.dtype}"
        )

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        return _gated(
            act_fn,
            xe,
            mxfp4_dequantize(w1_w3_blocks[e], w1_w3_scales[e], MXFP4_BLOCK),
            mxfp4_dequantize(w2_blocks[e], w2_scales[e], MXFP4_BLOCK),
            b1_w3=None if w1_w3_bias is None else w1_w3_bias[e].float(),
            b2=None if w2_bias is None else w2_bias[e].float(),
            gate_up_interleaved=gate_up_interleaved,
            alpha=swiglu_alpha,
            limit=swiglu_limit,
        )

    return _combine(x, selected_experts, routing_weights, expert)


torch_mxfp4_moe = _define_moe_op(
    "torch_mxfp4_moe(Tensor x, Tensor selected_experts, Tensor routing_weights, Tensor w1_w3_blocks, "
    "Tensor w1_w3_scales, Tensor? w1_w3_bias, Tensor w2_blocks, Tensor w2_scales, Tensor? w2_bias, "
    'str act_fn="silu", bool gate_up_interleaved=False, '
    f"float swiglu_alpha={SWIGLU_ALPHA}, float swiglu_limit={SWIGLU_LIMIT}) -> Tensor",
    mxfp4_moe,
)
