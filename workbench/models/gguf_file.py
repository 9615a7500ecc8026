"""A fast, dependency-light GGUF reader: header, metadata, tensor table and raw tensor bytes.

Why not ``gguf.GGUFReader``: it builds a numpy object per field *part*, so the 49k-token
vocabulary and 49k merges of SmolLM2 cost ~10 s before a single weight is touched. Here the
file is one read-only ``numpy.memmap``; scalars are read with ``struct``, numeric arrays with
one ``np.frombuffer`` each, and string arrays with a tight loop over a ``memoryview`` that
only slices and decodes. Tensor data is never read at parse time: ``GGUFTensor.data`` is a
zero-copy uint8 view of the map, so page-ins happen only when a weight is actually used.

Layout (GGUF v2/v3, little-endian): ``"GGUF"`` | u32 version | u64 tensor count | u64 kv
count | kvs | tensor infos | padding to ``general.alignment`` | tensor data. v1 (u32 counts)
is obsolete and rejected.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, List

import numpy as np

if TYPE_CHECKING:
    from transformers import LlamaConfig

# ggml type id -> (name as in gguf.GGMLQuantizationType, elements per block, bytes per block).
# Kept here (not imported from ``gguf``) because importing gguf costs ~150 ms.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# metadata value type id -> numpy dtype (fixed-size types only; 8 = string, 9 = array)
_SCALAR_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


class _Truncated(Exception):
    """Internal: a read ran past the end of the file (turned into a ValueError with the path)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. ``shape`` is in torch order (GGUF stores dims fastest-first, so it
    is reversed: a linear weight is ``(out_features, in_features)``); ``data`` is the tensor's raw
    bytes as a uint8 view into the memmap (no copy, read-only)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def rows(self) -> int:
        """Number of rows (product of all dims but the last, the blocked one)."""
        return prod(self.shape[:-1])


class GGUFFile:
    """Parsed GGUF file: ``path``, ``version``, ``metadata``, ``tensors`` (in file order),
    ``alignment``. Strings are ``str``, numeric scalars Python numbers, string arrays ``list[str]``
    and numeric arrays ``np.ndarray``. Raises ``ValueError`` naming the file for a non-GGUF,
    unsupported-version or truncated file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:  # np.memmap refuses empty files: look at the magic first
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected magic b'GGUF')")
        if size < 24:
            raise ValueError(f"{self.path}: truncated GGUF file ({size} bytes, shorter than the 24-byte header)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]  # numpy's stub: memmap is a buffer
        self._size = size
        (self.version,) = struct.unpack_from("<I", self._buf, 4)
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file, which is not supported)" if swapped in (2, 3) else ""
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version}{hint}; supported: 2, 3")
        try:
            self._parse()
        except (_Truncated, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF file ({size} bytes): {e}") from None

    def release(self, t: GGUFTensor) -> None:
        """Drop the mapped pages of ``t``'s bytes from this process's memory once a copy of them
        is made. They stay in the OS page cache and fault back in if read again (the map is
        read-only), but they no longer count in the process's RSS: without this, loading smollm2
        (100 MB file) held the whole file mapped beside its copies, 100 MB of peak RSS."""
        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or t.data.size == 0:
            return
        start = t.data.__array_interface__["data"][0] - self._map.__array_interface__["data"][0]
        first = start - start % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, first, start + t.data.size - first)
        except (OSError, ValueError):
            pass  # only memory: the load goes on with the pages mapped

    def _parse(self) -> None:
        n_tensors, n_kv = struct.unpack_from("<QQ", self._buf, 8)
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype = self._u32(pos)
            self.metadata[key], pos = self._value(vtype, pos + 4, key)
        self.alignment: int = int(self.metadata.get("general.alignment", 32))
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims = self._u32(pos)
            self._need(pos + 4, 8 * n_dims + 12, f"tensor info of {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(reversed(dims)), type_id, offset))
        data_start = -(-pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, type_id, offset in infos:
            if type_id not in GGML_TYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}")
            tname, block, block_bytes = GGML_TYPES[type_id]
            if shape and shape[-1] % block:
                raise ValueError(
                    f"{self.path}: tensor {name!r} row length {shape[-1]} not a multiple of {block} ({tname})"
                )
            nbytes = prod(shape) // block * block_bytes
            start = data_start + offset
            self._need(start, nbytes, f"data of tensor {name!r}")
            self.tensors[name] = GGUFTensor(name, tname, shape, self._map[start : start + nbytes].view(np.ndarray))

    # -- primitive readers (bounds-checked: slicing a memoryview past the end would silently shrink)
    def _need(self, pos: int, n: int, what: str) -> None:
        if pos + n > self._size:
            raise _Truncated(f"{what} needs bytes {pos}..{pos + n}, file ends at {self._size}")

    def _u32(self, pos: int) -> int:
        self._need(pos, 4, "u32")
        return struct.unpack_from("<I", self._buf, pos)[0]

    def _string(self, pos: int) -> tuple[str, int]:
        self._need(pos, 8, "string length")
        (n,) = _U64.unpack_from(self._buf, pos)
        self._need(pos + 8, n, "string")
        return str(self._buf[pos + 8 : pos + 8 + n], "utf-8"), pos + 8 + n

    def _value(self, vtype: int, pos: int, key: str) -> tuple[Any, int]:
        if vtype in _SCALAR_DTYPES:
            dt = np.dtype(_SCALAR_DTYPES[vtype])
            self._need(pos, dt.itemsize, f"value of {key!r}")
            return np.frombuffer(self._buf, dt, 1, pos)[0].item(), pos + dt.itemsize
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: metadata key {key!r} has unknown value type {vtype}")
        self._need(pos, 12, f"array header of {key!r}")
        etype, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if etype in _SCALAR_DTYPES:
            dt = np.dtype(_SCALAR_DTYPES[etype])
            self._need(pos, count * dt.itemsize, f"array {key!r}")
            return np.frombuffer(self._buf, dt, count, pos).copy(), pos + count * dt.itemsize
        if etype == _STRING:
            return self._string_array(pos, count, key)
        out = []  # arrays of arrays: rare and small, so the generic path is fine
        for _ in range(count):
            v, pos = self._value(etype, pos, key)
            out.append(v)
        return out, pos

    def _string_array(self, pos: int, count: int, key: str) -> tuple[list[str], int]:
        """Bulk string array: one pass that slices ``(u64 length, bytes)`` records out of the
        memoryview (``int.from_bytes`` + ``str(slice, 'utf-8')`` per entry, no struct/numpy objects);
        49k entries take ~20 ms. Bounds are checked once per array, at the end."""
        buf, size = self._buf, self._size
        out: List[Any] = []
        append, from_bytes = out.append, int.from_bytes
        for _ in range(count):  # a cut-off length field reads short, so `end` lands past the end too
            end = pos + 8 + from_bytes(buf[pos : pos + 8], "little")
            if end > size:
                break
            append(str(buf[pos + 8 : end], "utf-8"))
            pos = end
        if len(out) != count:
            raise _Truncated(f"string array {key!r} stops after {len(out)} of {count} entries")
        return out, pos

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


# ---------------------------------------------------------------------------------------------
# Block splitting and dequantization (vectorised; bit-exact with gguf.quants.dequantize)


def _split(t: GGUFTensor, kind: str, block_bytes: int, n_f16: int) -> tuple[np.ndarray, ...]:
    """Cut each block into its ``n_f16`` leading f16 fields (each ``[..., K/32]``) and the quant bytes
    that follow (concatenated per row: ``[..., bytes per row]``), as contiguous arrays."""
    if t.ggml_type != kind:
        raise ValueError(f"tensor {t.name!r} is {t.ggml_type}, expected {kind}")
    lead, n_blocks = t.shape[:-1], t.shape[-1] // 32
    b = t.data.reshape(t.rows, n_blocks, block_bytes)
    qs = np.ascontiguousarray(b[:, :, 2 * n_f16 :]).reshape(*lead, -1)
    return qs, *(
        np.ascontiguousarray(b[:, :, 2 * i : 2 * i + 2]).view(np.float16).reshape(*lead, n_blocks) for i in range(n_f16)
    )


def split_q4_1(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 -> ``(qweight u8 [N, K/2], scales f16 [N, K/32], offsets f16 [N, K/32])``.

    A block is 32 weights in 20 bytes: f16 ``d``, f16 ``m``, 16 bytes ``qs``. Weight j (0..15)
    is the low nibble of ``qs[j]``, weight j+16 its high nibble; value = q*d + m. ``qweight`` is
    the ``qs`` bytes concatenated per row, i.e. that nibble order is kept as is."""
    return _split(t, "Q4_1", 20, 2)  # type: ignore[return-value]


def split_q4_0(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 -> ``(qweight u8 [N, K/2], scales f16 [N, K/32])``. Block: f16 ``d`` + 16 bytes ``qs``
    (same nibble order as Q4_1); value = (q - 8) * d."""
    return _split(t, "Q4_0", 18, 1)  # type: ignore[return-value]


def split_q8_0(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 -> ``(qweight i8 [N, K], scales f16 [N, K/32])``. Block: f16 ``d`` + 32 int8; value = q*d."""
    qs, d = _split(t, "Q8_0", 34, 1)
    return qs.view(np.int8), d


def _unpack_nibbles(qweight: np.ndarray) -> np.ndarray:
    """u8 ``[..., K/2]`` -> u8 ``[..., K/32, 32]`` in weight order (per 16 bytes: low nibbles, then high)."""
    q = qweight.reshape(*qweight.shape[:-1], -1, 1, 16)
    return np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*qweight.shape[:-1], -1, 32)


def dequantize(t: GGUFTensor) -> np.ndarray:
    """The tensor as a new float32 array of shape ``t.shape``; bit-identical to
    ``gguf.quants.dequantize`` (same float32 op order: q*d, then + m)."""
    kind, shape = t.ggml_type, t.shape
    if kind == "F32":
        return t.data.view(np.float32).reshape(shape).copy()
    if kind == "F16":
        return t.data.view(np.float16).astype(np.float32).reshape(shape)
    if kind == "BF16":
        return (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if kind == "Q8_0":
        q, d = split_q8_0(t)
        q = q.reshape(*d.shape, 32).astype(np.float32)
        return (q * d.astype(np.float32)[..., None]).reshape(shape)
    if kind == "Q4_0":
        q, d = split_q4_0(t)
        q = (_unpack_nibbles(q).astype(np.int8) - np.int8(8)).astype(np.float32)
        return (d.astype(np.float32)[..., None] * q).reshape(shape)
    if kind == "Q4_1":
        q, d, m = split_q4_1(t)
        q = _unpack_nibbles(q).astype(np.float32)
        return (d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]).reshape(shape)
    raise NotImplementedError(
        f"cannot dequantize tensor {t.name!r} of type {kind}; supported: {', '.join(DEQUANTIZABLE)}"
    )


# ---------------------------------------------------------------------------------------------
# llama architecture: names, Q/K row order, config

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """transformers' parameter name for a llama GGUF tensor name, or None if it has none
    (e.g. ``rope_freqs.weight``, which transformers recomputes from the config)."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def qk_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation: ``W_hf = W_gguf[order]``.

    HF llama applies RoPE to the two halves of each head (``rotate_half``); llama.cpp rotates
    adjacent pairs, so its converter interleaves each head's rows (row ``i`` of the first half and
    row ``i`` of the second half become rows ``2i`` and ``2i+1``). Undoing it is a pure row
    permutation, so it applies unchanged to quantized row data (qweight/scales/offsets). For
    ``attn_k`` pass the number of KV heads."""
    if n_rows % (2 * n_head):
        raise ValueError(f"{n_rows} rows cannot be split into {n_head} heads of (pairs of) rows")
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


_LLAMA_CONFIG_KEYS = {  # the renames transformers applies (integrations/ggml.py GGUF_CONFIG_MAPPING)
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.vocab_size": "vocab_size",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "general.name": "_model_name_or_path",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def llama_config_from_gguf(f: GGUFFile) -> LlamaConfig:
    """The ``LlamaConfig`` transformers derives from this file (same fields and values: a key the
    file lacks keeps the LlamaConfig default, as there). Like transformers, ``rope.scaling.*``
    keys and the ``rope_freqs`` tensor are not used."""
    from transformers import LlamaConfig

    md = f.metadata
    if md.get("general.architecture") != "llama":
        raise ValueError(
            f"{f.path}: architecture {md.get('general.architecture')!r} is not supported here; only 'llama'"
        )
    missing = [k for k in ("block_count", "embedding_length", "attention.head_count") if f"llama.{k}" not in md]
    if missing:
        raise ValueError(f"{f.path}: llama metadata lacks {', '.join('llama.' + k for k in missing)}")
    kwargs: dict[str, Any] = {hf: md[key] for key, hf in _LLAMA_CONFIG_KEYS.items() if key in md}
    if "vocab_size" not in kwargs and "tokenizer.ggml.tokens" in md:
        kwargs["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    if "llama.rope.freq_base" in md:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": md["llama.rope.freq_base"]}
    # llama.cpp writes output.weight only when it is not the embedding matrix
    kwargs["tie_word_embeddings"] = "output.weight" not in f.tensors
    return LlamaConfig(**kwargs)
