"""Low-level quantization format codecs: plain torch, no workbench imports, no op registration.

The formats the quantized ops (``fp8.py``, ``nvfp4.py``, ``quant_moe.py``, ...) consume, written
once so that ops, checkpoint loaders and quantization utilities agree bit for bit:

- FP8 e4m3 (``float8_e4m3fn``, max 448): per tensor, per 2-D block (HF "fine-grained FP8" /
  DeepSeek ``weight_scale_inv``), per token and group of columns (dynamic activations).
- FP4 e2m1 codes (sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), two per byte.
- NVFP4 (ModelOpt): e2m1 * fp8 block scale (16 columns) * fp32 global scale.
- MXFP4 (OCP): e2m1 * e8m0 power-of-two block scale (32 columns).
- GPTQ 4-bit storage (int32 words of 8 codes) and grouped int4 (codes * scales + offsets).

Every quantizer works in fp32 whatever the input dtype. A scale that would be 0 (an all-zero tensor or
block) is 1 instead, so quantize never divides 0 by 0 and the zeros still round-trip exactly.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The relative step of each grid activations are rounded to (a value's spacing over the value, at the
# coarsest: 2**-mantissa_bits): what an op that quantizes its input declares as ``activation_rounding``.
FP8_E4M3_STEP = 2.0**-3
FP4_E2M1_STEP = 2.0**-1
INT8_BLOCK_STEP = 2.0**-7  # symmetric int8 with one scale per block of 32 (llama.cpp's Q8_1)
# The 8 non-negative e2m1 magnitudes; code c (0..7) is E2M1_VALUES[c], code c + 8 is its negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 255  # OCP MX: the one e8m0 code that is not a power of two


# ----------------------------------------------------------------------------------------- helpers
def _nonzero_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with zeros replaced by 1 (all-zero tensors/blocks quantize to zeros)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _last_dim_blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """[..., K] -> [..., K/block, block]; K must be a multiple of ``block``."""
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(
            f"{what}: the last dimension ({tuple(x.shape)}) must be a multiple of the "
            f"block size {block}; pad the tensor or leave this layer unquantized"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _expand_last(scales: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Per-group scales [..., ceil(K/block)] -> per-column [..., K] (a partial last group allowed)."""
    return scales.repeat_interleave(block, dim=-1)[..., :k]


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


# --------------------------------------------------------------------------------------------- FP8
def to_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """``x / scale`` clamped to +-448 and cast to ``float8_e4m3fn``: saturating on every device (what a
    plain cast does with out-of-range values differs between devices and versions; NaN on CUDA).
    ``scale`` broadcasts against ``x``."""
    y = x.float() / (scale.float() if isinstance(scale, torch.Tensor) else float(scale))
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_per_tensor_quantize(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (w_fp8, scale fp32 0-d) with scale = amax / 448, so ``w ~= w_fp8 * scale``."""
    if w.numel() == 0:
        raise ValueError("fp8_per_tensor_quantize: empty tensor has no amax")
    scale = _nonzero_scale(w.detach().abs().amax().float() / FP8_E4M3_MAX)
    return to_fp8(w, scale), scale


def _check_block(block, what: str) -> Tuple[int, int]:
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ValueError(f"{what}: block must be two positive sizes (rows, columns), got {block!r}")
    return int(block[0]), int(block[1])


def _expand_block_scales(scale: torch.Tensor, block: Tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[..., ceil(N/bn), ceil(K/bk)] -> [..., N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def expand_block_scales(
    scale_inv: torch.Tensor, weight_shape: Tuple[int, ...], block: Tuple[int, int], what: str
) -> torch.Tensor:
    """One scale per (bn x bk) tile of a [..., N, K] weight, [..., ceil(N/bn), ceil(K/bk)] (partial
    tiles at the right / bottom edge count) -> fp32 [..., N, K]. ``what`` names the caller in the
    error a scale tensor of another shape gets."""
    n, k = weight_shape[-2:]
    want = (*weight_shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{what}: weight {tuple(weight_shape)} with block {block} needs "
            f"scale_inv of shape {want}, got {tuple(scale_inv.shape)}"
        )
    return _expand_block_scales(scale_inv.float(), block, n, k)


def fp8_block_quantize(w: torch.Tensor, block=(128, 128)) -> Tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] -> (w_fp8 [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)]).

    One scale per (bn x bk) tile, amax / 448; partial tiles at the right/bottom edge are allowed
    (the HF "fine-grained FP8" / DeepSeek-V3 layout, whose ``weight_scale_inv`` multiplies back).
    Leading dimensions (stacked experts) are kept.
    """
    bn, bk = _check_block(block, "fp8_block_quantize")
    if w.dim() < 2:
        raise ValueError(f"fp8_block_quantize: needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.detach().float().abs(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    scale_inv = _nonzero_scale(tiles.amax(dim=(-3, -1)) / FP8_E4M3_MAX)
    return to_fp8(w, _expand_block_scales(scale_inv, (bn, bk), n, k)), scale_inv


def fp8_block_dequantize(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Inverse of ``fp8_block_quantize``: fp32 [..., N, K] = w_fp8 * scale_inv of its tile."""
    block = _check_block(block, "fp8_block_dequantize")
    return w_fp8.float() * expand_block_scales(scale_inv, w_fp8.shape, block, "fp8_block_dequantize")


def fp8_group_quantize(x: torch.Tensor, group: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization, one scale per token per ``group`` columns:
    x [..., K] -> (x_fp8 [..., K], scales fp32 [..., ceil(K/group)]); a partial last group is allowed."""
    if group < 1:
        raise ValueError(f"fp8_group_quantize: group must be positive, got {group}")
    k = x.shape[-1]
    groups = _pad_last(x.detach().float().abs(), group).reshape(*x.shape[:-1], -1, group)
    scales = _nonzero_scale(groups.amax(dim=-1) / FP8_E4M3_MAX)
    return to_fp8(x, _expand_last(scales, group, k)), scales


def fp8_group_dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Inverse of ``fp8_group_quantize``: fp32 [..., K]."""
    k = x_fp8.shape[-1]
    want = (*x_fp8.shape[:-1], -(-k // group))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"fp8_group_dequantize: x {tuple(x_fp8.shape)} with group {group} needs scales "
            f"of shape {want}, got {tuple(scales.shape)}"
        )
    return x_fp8.float() * _expand_last(scales.float(), group, k)


# ------------------------------------------------------------------------------------- FP4 (e2m1)
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) -> uint8 codes 0..15: bit 3 the sign, bits 0-2 the index of
    the nearest magnitude in ``E2M1_VALUES``; ties go to the even code (IEEE round-half-even on the
    mantissa bit), magnitudes above 6 saturate to 6. -0.0 and small negatives give code 8 (-0), so
    every code round-trips. NaN encodes as +-0 (check inputs upstream if that matters)."""
    mag = x.detach().float().abs().clamp(max=E2M1_MAX)
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for c in range(len(E2M1_VALUES) - 1):
        mid = (E2M1_VALUES[c] + E2M1_VALUES[c + 1]) / 2
        # From an even code c a tie stays at c (strict >); from an odd c it moves up to c + 1 (>=).
        index += (mag > mid) if c % 2 == 0 else (mag >= mid)
    return index | (torch.signbit(x.detach().float()).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values (code 8 is -0.0)."""
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"e2m1_decode: codes must be an integer tensor (uint8), got {codes.dtype}")
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[(codes.to(torch.int64) & 15)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] -> uint8 [..., K/2]: element 2i in the low nibble, 2i + 1 in the high nibble
    (ModelOpt NVFP4 and OCP MXFP4 checkpoints' byte order)."""
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even (two codes a byte), got {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 15
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of ``pack_fp4``)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4: packed FP4 data must be uint8, got {packed.dtype}")
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ------------------------------------------------------------------------------------------ NVFP4
def nvfp4_quantize(
    w: torch.Tensor, global_scale: Optional[torch.Tensor] = None, block: int = 16
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] -> (packed uint8 [..., K/2], block_scales float8_e4m3fn [..., K/block], global_scale fp32 0-d).

    ModelOpt's convention: ``global_scale`` (their ``weight_scale_2``; for activations the
    ``input_scale``) = amax / (6 * 448) unless given, so the largest block scale lands at the fp8
    maximum; block scale = block_amax / 6 / global_scale, stored in fp8;
    value = e2m1 * block_scale * global_scale. Values are divided by the *stored* (rounded) block
    scale, so the fp8 rounding of the scale costs at most a saturation at +-6.
    """
    blocks = _last_dim_blocks(w.detach().float(), block, "nvfp4_quantize")
    if global_scale is None:
        if w.numel() == 0:
            raise ValueError("nvfp4_quantize: empty tensor has no amax")
        global_scale = _nonzero_scale(blocks.abs().amax() / (E2M1_MAX * FP8_E4M3_MAX))
    if global_scale.numel() != 1:
        raise ValueError(f"nvfp4_quantize: global_scale must be one value, got shape {tuple(global_scale.shape)}")
    global_scale = global_scale.detach().float().reshape(())
    block_scales = to_fp8(blocks.abs().amax(dim=-1) / E2M1_MAX, global_scale)
    step = block_scales.float() * global_scale  # what one e2m1 unit is worth, per block
    codes = e2m1_encode(blocks / _nonzero_scale(step)[..., None]).reshape(w.shape)
    return pack_fp4(codes), block_scales, global_scale


def nvfp4_dequantize(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, block: int = 16
) -> torch.Tensor:
    """Inverse of ``nvfp4_quantize``: fp32 [..., K] = e2m1 * block_scale * global_scale."""
    return _fp4_dequantize(
        "nvfp4_dequantize",
        packed,
        (block_scales, "block_scales"),
        block,
        lambda s: s.float() * global_scale.float().reshape(()),
    )


def _fp4_dequantize(
    what: str, packed: torch.Tensor, scales: Tuple[torch.Tensor, str], block: int, step
) -> torch.Tensor:
    """fp32 [..., K]: the e2m1 values of ``packed`` times ``step(scales)`` [..., K/block], one per
    block of ``block`` along the last dim; ``scales`` is (tensor, its name in the error)."""
    values = e2m1_decode(unpack_fp4(packed))
    want = (*values.shape[:-1], values.shape[-1] // block)
    if values.shape[-1] % block or tuple(scales[0].shape) != want:
        raise ValueError(
            f"{what}: packed {tuple(packed.shape)} (K = {values.shape[-1]}) with block "
            f"{block} needs {scales[1]} of shape {want}, got {tuple(scales[0].shape)}"
        )
    return (values.reshape(*want, block) * step(scales[0])[..., None]).reshape(values.shape)


# ------------------------------------------------------------------------------------ E8M0 / MXFP4
def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Positive scales -> uint8 e8m0 codes (exponent + 127) of the smallest power of two >= scale
    (rounding up, so ``x / decoded`` never exceeds what ``x / scale`` would). Clamped to the codes
    0..254 (2^-127 .. 2^127); zeros give code 0."""
    mantissa, exponent = torch.frexp(scale.detach().float())  # scale = m * 2^e, m in [0.5, 1)
    exact_power = (mantissa == 0.5).to(exponent.dtype)
    e = torch.where(scale > 0, exponent - exact_power, torch.full_like(exponent, -E8M0_BIAS))
    return (e.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 codes -> fp32 2**(code - 127); code 255 is NaN (OCP MX)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode: e8m0 scales must be uint8, got {codes.dtype}")
    e = codes.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device), e)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, math.nan), values)


def mxfp4_quantize(w: torch.Tensor, block: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (packed uint8 [..., K/2], scales uint8 e8m0 [..., K/block]).

    Block scale = the power of two >= block_amax / 6 (so nothing saturates); value = e2m1 * 2^(s - 127).
    """
    blocks = _last_dim_blocks(w.detach().float(), block, "mxfp4_quantize")
    scales = e8m0_encode(blocks.abs().amax(dim=-1) / E2M1_MAX)
    codes = e2m1_encode(blocks / e8m0_decode(scales)[..., None]).reshape(w.shape)
    return pack_fp4(codes), scales


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of ``mxfp4_quantize``: fp32 [..., K] = e2m1 * 2^(scale - 127)."""
    return _fp4_dequantize("mxfp4_dequantize", packed, (scales, "scales"), block, e8m0_decode)


# ------------------------------------------------------------------------------------ GPTQ storage
_NIBBLES = 8  # 4-bit codes per int32 word


def _pack_nibbles(codes: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """Codes 0..15 -> int32 words of 8 consecutive codes along ``dim`` (code j in bits 4j..4j+3)."""
    if codes.dim() != 2 or codes.shape[dim] % _NIBBLES:
        raise ValueError(
            f"{what}: needs a 2-D tensor whose dimension {dim} is a multiple of 8, got shape {tuple(codes.shape)}"
        )
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, _NIBBLES) & 15
    shifts = torch.arange(0, 4 * _NIBBLES, 4, device=codes.device)
    words = (c << shifts).sum(dim=-1)  # 0 .. 2^32 - 1; the bit pattern is what int32 stores
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def _unpack_nibbles(words: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    if words.dtype != torch.int32 or words.dim() != 2:
        raise TypeError(f"{what}: needs a 2-D int32 tensor (GPTQ storage), got {words.dtype} {tuple(words.shape)}")
    w = words.movedim(dim, -1)
    shifts = torch.arange(0, 4 * _NIBBLES, 4, device=words.device, dtype=torch.int32)
    codes = (w[..., None] >> shifts) & 15  # arithmetic shift: the sign bits are masked off
    return codes.reshape(*w.shape[:-1], -1).to(torch.uint8).movedim(-1, dim)


def gptq_pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """Weight codes [K, N] (0..15) -> qweight int32 [K/8, N]: row 8i + j in bits 4j..4j+3 of row i."""
    return _pack_nibbles(codes, 0, "gptq_pack_rows")


def gptq_unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> uint8 codes [K, N]."""
    return _unpack_nibbles(qweight, 0, "gptq_unpack_rows")


def gptq_pack_cols(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points [G, N] (0..15) -> qzeros int32 [G, N/8]: column 8i + j in bits 4j..4j+3."""
    return _pack_nibbles(zeros, 1, "gptq_pack_cols")


def gptq_unpack_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [G, N/8] -> uint8 zero points [G, N]."""
    return _unpack_nibbles(qzeros, 1, "gptq_unpack_cols")


def gptq_default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """The ``g_idx`` of a checkpoint quantized without act-order: column k is in group k // group_size."""
    return torch.arange(in_features, device=device, dtype=torch.int32) // group_size


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, zero_offset: int = 1
) -> torch.Tensor:
    """GPTQ storage -> fp32 weight [N, K] (``nn.Linear`` layout):
    w[n, k] = (q[k, n] - (z[g_idx[k], n] + zero_offset)) * scales[g_idx[k], n].

    ``zero_offset=1`` reads the classic AutoGPTQ format, which stores every zero point minus one
    (so a zero point of 0 is not representable: it wraps to 15, read back as 16);
    ``zero_offset=0`` reads the "v2" format (GPTQModel, AutoRound), which stores them as they are.
    ``g_idx`` [K] maps each input column to its group (act-order checkpoints permute it).
    """
    q = gptq_unpack_rows(qweight)  # [K, N]
    z = gptq_unpack_cols(qzeros)  # [G, N]
    k, n = q.shape
    if tuple(scales.shape) != tuple(z.shape) or z.shape[1] != n or tuple(g_idx.shape) != (k,):
        raise ValueError(
            f"gptq_dequantize: qweight {tuple(qweight.shape)} -> codes [K={k}, N={n}] needs "
            f"qzeros [G, {n // 8}], scales [G, {n}] and g_idx [{k}]; got qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}"
        )
    g = g_idx.to(torch.int64)
    zero = z.to(torch.float32).index_select(0, g) + zero_offset  # [K, N]
    return ((q.float() - zero) * scales.float().index_select(0, g)).t()


# -------------------------------------------------------------------------------- grouped int4
def int4_quantize_groups(
    w: torch.Tensor, group_size: int, symmetric: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes uint8 [N, K] in 0..15, scales fp32 [N, K/g], offsets fp32 [N, K/g]) with
    ``w ~= codes * scales + offsets`` per group of ``group_size`` columns -- the form of
    ``torch_int4_linear`` (pack the codes with ``int4.pack_int4``).

    symmetric: scale = amax / 7, codes = round(w / scale) + 8 clamped to 0..15, offsets = -8 * scale.
    asymmetric: scale = (max - min) / 15, offset = min, codes = round((w - min) / scale).
    Rounding error is at most half a scale per element.
    """
    if w.dim() != 2:
        raise ValueError(f"int4_quantize_groups: needs a 2-D weight [N, K], got {tuple(w.shape)}")
    groups = _last_dim_blocks(w.detach().float(), group_size, "int4_quantize_groups")
    if symmetric:
        scales = _nonzero_scale(groups.abs().amax(dim=-1) / 7)
        offsets = -8 * scales
    else:
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        scales, offsets = _nonzero_scale((hi - lo) / 15), lo
    codes = torch.round((groups - offsets[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(w.shape), scales, offsets
