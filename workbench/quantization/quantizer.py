"""``TensorQuantizer``: a small, ModelOpt-shaped fake quantizer that the export utilities read.

ModelOpt attaches ``TensorQuantizer`` modules to a layer (``weight_quantizer``, ``input_quantizer``,
``output_quantizer``; ``k_bmm_quantizer`` / ``v_bmm_quantizer`` on attention) and the export code
reads their settings and calibrated ``amax``. This class holds the same attributes, under the same
names, so the utilities in this package work on real modules and their state dicts carry ModelOpt's
keys (``..._quantizer._amax``, ``..._pre_quant_scale``, ``..._bias_value``):

- ``num_bits``: an int (integer formats: 4, 8) or (exponent, mantissa) bits of a float format:
  ``(4, 3)`` FP8 e4m3, ``(2, 1)`` FP4 e2m1.
- ``axis`` (one amax per index of that dim) or ``block_sizes`` (ModelOpt's dict: ``{-1: g}`` one
  amax per g values of the last dim; ``{-1: b, -2: b}`` per b x b tile; FP4 has
  ``{-1: 16, "type": "dynamic", "scale_bits": (4, 3)}`` (NVFP4) or ``scale_bits (8, 0)`` (MXFP4),
  whose block scales are computed on the fly and whose ``amax`` is one per-tensor (global) value).
- ``amax`` (fp32 buffer ``_amax``), ``pre_quant_scale`` (``_pre_quant_scale``: the AWQ /
  SmoothQuant per-input-channel factor, applied before quantizing -- even when the quantizer itself
  is disabled, as for weight-only AWQ), ``bias_value`` (``_bias_value``: the affine KV-cache offset).
  Each is a buffer only while it is set, so ``hasattr(q, "_pre_quant_scale")`` means "has one".

``amax`` layouts: per tensor 0-d; ``axis=a``: 1-D [x.shape[a]]; ``{-1: g}``: [..., K/g];
``{-1: b, -2: b}``: [..., ceil(N/b), ceil(K/b)].

The forward quantizes then dequantizes (same dtype out): FP8 calls
``torch.ops.workbench.torch_fake_quant_fp8`` and NVFP4 ``torch_fake_quant_nvfp4``, so an exported
model carries the nodes the ``quantize_*_from_graph`` transforms look for; MXFP4 does the
quantize-dequantize with the codecs of ``workbench.ops.quant.codecs``, integers with round/clamp.
In ``collecting`` mode the forward records the running amax of what it sees and passes it through
unquantized (calibration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Tuple, Union, overload

import torch
import torch.nn as nn

from ..ops.quant import codecs
from ..ops.quant import fake_quant as _fake_quant_ops  # noqa: F401  (registers the fake-quant ops)

NumBits = Union[int, Tuple[int, int]]

# The largest magnitude each float format represents (what amax maps to).
FLOAT_MAXBOUND = {(4, 3): codecs.FP8_E4M3_MAX, (2, 1): codecs.E2M1_MAX}


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Zeros -> 1: an all-zero tensor/block quantizes to zeros whatever its scale."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


class _OptionalBuffer:
    """A ``TensorQuantizer`` attribute kept as the buffer ``_<name>`` while set: None until then,
    and setting None removes the buffer (``_set_buffer``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.buffer = "_" + name

    @overload
    def __get__(self, obj: None, owner: type) -> "_OptionalBuffer": ...

    @overload
    def __get__(self, obj: "TensorQuantizer", owner: type) -> Optional[torch.Tensor]: ...

    def __get__(self, obj, owner):
        return self if obj is None else obj._buffers.get(self.buffer)

    def __set__(self, obj: "TensorQuantizer", value: Optional[torch.Tensor]) -> None:
        obj._set_buffer(self.buffer, value)


class TensorQuantizer(nn.Module):
    """Fake quantizer with ModelOpt's attributes; see the module docstring for the layouts."""

    def __init__(
        self,
        num_bits: NumBits = 8,
        *,
        axis: Optional[int] = None,
        block_sizes: Optional[dict] = None,
        unsigned: bool = False,
        enabled: bool = True,
    ):
        super().__init__()
        if isinstance(num_bits, list):
            num_bits = tuple(num_bits)
        if isinstance(num_bits, tuple):
            if num_bits not in FLOAT_MAXBOUND:
                raise ValueError(
                    f"TensorQuantizer: float num_bits {num_bits} not supported; use (4, 3) (fp8 "
                    "e4m3) or (2, 1) (fp4 e2m1)"
                )
        elif not isinstance(num_bits, int) or not 2 <= num_bits <= 8:
            raise ValueError(f"TensorQuantizer: num_bits must be an int in 2..8 or (4, 3) / (2, 1), got {num_bits!r}")
        if axis is not None and block_sizes:
            raise ValueError("TensorQuantizer: give axis (per channel) or block_sizes (per block), not both")
        block_sizes = dict(block_sizes) if block_sizes else None
        if block_sizes is not None:
            dims = [k for k in block_sizes if isinstance(k, int)]
            if not dims or not set(dims) <= {-1, -2} or any(block_sizes[d] < 1 for d in dims):
                raise ValueError(
                    f"TensorQuantizer: block_sizes needs positive sizes for -1 (and optionally -2), got {block_sizes}"
                )
            if block_sizes.get("type", "static") not in ("static", "dynamic"):
                raise ValueError(
                    f"TensorQuantizer: block_sizes type must be 'static' or 'dynamic', got {block_sizes['type']!r}"
                )
        if num_bits == (2, 1):
            ok = (
                block_sizes is not None
                and block_sizes.get("type") == "dynamic"
                and -2 not in block_sizes
                and tuple(block_sizes.get("scale_bits", ())) in ((4, 3), (8, 0))
            )
            if not ok:
                raise ValueError(
                    "TensorQuantizer: FP4 needs block_sizes={-1: 16, 'type': 'dynamic', 'scale_bits': "
                    "(4, 3)} (NVFP4) or {-1: 32, 'type': 'dynamic', 'scale_bits': (8, 0)} (MXFP4)"
                )
        self.num_bits = num_bits
        self.axis = axis
        self.block_sizes = block_sizes
        self.unsigned = unsigned
        self._enabled = enabled
        self.collecting = False  # calibration mode: record amax, pass values through

    # ------------------------------------------------------------------------------ settings
    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    @property
    def maxbound(self) -> float:
        """The largest quantized magnitude: 2^(b-1) - 1 for signed ints (127, 7), 448 fp8, 6 fp4."""
        if isinstance(self.num_bits, tuple):
            return FLOAT_MAXBOUND[self.num_bits]
        return float(2**self.num_bits - 1 if self.unsigned else 2 ** (self.num_bits - 1) - 1)

    @property
    def block_size(self) -> int:
        """Block size along the last dim (0: not block quantized)."""
        return int(self.block_sizes.get(-1, 0)) if self.block_sizes else 0

    @property
    def scale_bits(self) -> Optional[Tuple[int, int]]:
        scale_bits = self.block_sizes.get("scale_bits") if self.block_sizes else None
        return tuple(scale_bits) if scale_bits is not None else None

    @property
    def is_dynamic_block(self) -> bool:
        return self.block_sizes is not None and bool(self.block_sizes) and self.block_sizes.get("type") == "dynamic"

    # ------------------------------------------------------------------------ optional buffers
    def _set_buffer(self, name: str, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self._buffers.pop(name, None)
        else:
            self._buffers[name] = torch.as_tensor(value).detach().float().clone()

    amax = _OptionalBuffer()
    pre_quant_scale = _OptionalBuffer()
    bias_value = _OptionalBuffer()

    def reset_amax(self) -> None:
        self._set_buffer("_amax", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The optional buffers exist only while set: create the ones a checkpoint carries, so a fresh
        # quantizer loads a calibrated one's state dict.
        for name in ("_amax", "_pre_quant_scale", "_bias_value"):
            if prefix + name in state_dict and name not in self._buffers:
                self._set_buffer(name, torch.zeros(state_dict[prefix + name].shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------------------ calibration
    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """The amax of ``x`` in this quantizer's layout (module docstring), fp32."""
        a = x.detach().float().abs()
        if self.is_dynamic_block or (self.axis is None and not self.block_sizes):
            return a.amax()
        if self.axis is not None:
            axis = self.axis % a.dim()
            return a.amax(dim=[d for d in range(a.dim()) if d != axis]) if a.dim() > 1 else a
        assert self.block_sizes is not None  # neither per tensor nor per axis: per block
        bk = self.block_sizes[-1]
        if -2 not in self.block_sizes:
            if a.shape[-1] % bk:
                raise ValueError(
                    f"TensorQuantizer: last dim of {tuple(a.shape)} is not a multiple of the block size {bk}"
                )
            return a.reshape(*a.shape[:-1], -1, bk).amax(dim=-1)
        bn = self.block_sizes[-2]
        n, k = a.shape[-2:]
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(a, (0, kb * bk - k, 0, nb * bn - n))
        return padded.reshape(*a.shape[:-2], nb, bn, kb, bk).amax(dim=(-3, -1))

    def collect(self, x: torch.Tensor) -> None:
        """Fold ``x`` into the running amax (the max over every tensor collected)."""
        new = self.amax_of(x)
        old = self.amax
        if old is not None and old.shape != new.shape:
            raise ValueError(
                f"TensorQuantizer: amax of shape {tuple(new.shape)} does not match the calibrated "
                f"{tuple(old.shape)}; reset_amax() before calibrating another tensor shape"
            )
        self.amax = new if old is None else torch.maximum(old, new.to(old.device))

    # ----------------------------------------------------------------------------- fake quant
    def _expand(self, per_layout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """amax-layout values -> broadcastable against ``x``."""
        if per_layout.dim() == 0:
            return per_layout
        if self.axis is not None:
            shape = [1] * x.dim()
            shape[self.axis % x.dim()] = -1
            return per_layout.reshape(shape)
        assert self.block_sizes is not None  # neither per tensor nor per axis: per block
        bk = self.block_sizes[-1]
        out = per_layout.repeat_interleave(bk, dim=-1)[..., : x.shape[-1]]
        if -2 in self.block_sizes:
            out = out.repeat_interleave(self.block_sizes[-2], dim=-2)[..., : x.shape[-2], :]
        return out

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_bits == (2, 1) and self.scale_bits == (8, 0):  # MXFP4: scales from the values alone
            packed, scales = codecs.mxfp4_quantize(x, self.block_size)
            return codecs.mxfp4_dequantize(packed, scales, self.block_size).to(x.dtype)
        amax = self.amax
        if amax is None:
            raise RuntimeError(
                "TensorQuantizer: no amax; calibrate first (collect(tensor), or run the module "
                "inside workbench.quantization.calibrating(module))"
            )
        amax = amax.to(x.device)
        if self.num_bits == (2, 1):
            return torch.ops.workbench.torch_fake_quant_nvfp4(x, amax, self.block_size)
        if self.num_bits == (4, 3):  # the op's amax broadcasts: per tensor, channel or block alike
            return torch.ops.workbench.torch_fake_quant_fp8(x, self._expand(amax, x))
        bound = self.maxbound
        low = 0.0 if self.unsigned else -bound - 1
        scale = self._expand(_nonzero(amax / bound), x)
        return (torch.round(x.float() / scale).clamp(low, bound) * scale).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pqs = self.pre_quant_scale
        if pqs is not None:
            x = x * pqs.to(x.dtype)
        if not self._enabled:
            return x
        if self.collecting:
            self.collect(x)
            return x
        return self._fake_quant(x)

    def extra_repr(self) -> str:
        parts = [f"num_bits={self.num_bits}", "enabled" if self._enabled else "disabled"]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.block_sizes:
            parts.append(f"block_sizes={self.block_sizes}")
        if self.amax is not None:
            parts.append(f"amax={tuple(self.amax.shape) or float(self.amax):}")
        return ", ".join(parts)


class SequentialQuantizer(nn.Sequential):
    """Quantizers applied one after another: W4A8-AWQ weights are [int4 groups, fp8 per tensor]."""

    if TYPE_CHECKING:  # its children are TensorQuantizers

        def __iter__(self) -> Iterator[TensorQuantizer]: ...

        @overload
        def __getitem__(self, idx: slice) -> SequentialQuantizer: ...

        @overload
        def __getitem__(self, idx: int) -> TensorQuantizer: ...

        def __getitem__(self, idx: Union[slice, int]) -> Union[SequentialQuantizer, TensorQuantizer]: ...

    @property
    def is_enabled(self) -> bool:
        return any(q.is_enabled for q in self)

    def enable(self) -> None:
        for q in self:
            q.enable()

    def disable(self) -> None:
        for q in self:
            q.disable()

    def reset_amax(self) -> None:
        for q in self:
            q.reset_amax()

    def collect(self, x: torch.Tensor) -> None:
        """Calibrate every stage on ``x`` itself (as ModelOpt's stats collection does)."""
        for q in self:
            q.collect(x)
