"""A llama-architecture GGUF file as an HF model, with its quantized weights kept as they are.

``load_gguf_model(path, weights="keep")`` builds ``LlamaForCausalLM`` on ``meta`` from the file's
config (``gguf_file.llama_config_from_gguf``) and installs the file's tensors:

* ``keep`` (the default): every Q4_0/Q4_1 matrix becomes a ``QuantizedLinear`` whose forward is the
  canonical ``torch_int4_linear`` (group 32; Q4_1: scales = d, offsets = m; Q4_0: offsets = -8 d),
  every Q8_0 matrix a ``QuantizedLinear`` over ``torch_int8_linear`` (or, for the token embedding,
  a ``QuantizedEmbedding`` over ``torch_int8_embedding``); the tied LM head shares the embedding's
  tensors. No fp32 copy of a quantized weight is ever held: the reference ops dequantize one
  matrix at a time, the CPU kernels (``linear_weight_layout: kernel``) read the packed bytes.
  ``export_to_gm`` traces these modules like any other, so the graph carries the canonical ops
  from the start, and the numerics probe compares against this same eager model.
* ``dequantize``: every tensor dequantized to fp32 (``gguf_file.dequantize``, bit-identical to the
  ``gguf`` package) in plain ``nn.Linear``/``nn.Embedding`` -- the fp32 model the Q4_1 one is
  compared with.

llama.cpp's converter interleaves the rows of ``attn_q``/``attn_k`` per head; the inverse row
permutation (``qk_row_order``) is applied to the packed rows, scales and offsets alike.
The quantized tensors are copied out of the memory map once (the block layout interleaves scales
with codes), then the map is closed, so no file pages stay resident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Literal, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from .gguf_file import (
    GGUFFile,
    GGUFTensor,
    dequantize,
    hf_name,
    llama_config_from_gguf,
    qk_row_order,
    split_q4_0,
    split_q4_1,
    split_q8_0,
)

GGUFWeights = Literal["keep", "dequantize"]
GROUP = 32  # every ggml block format here quantizes runs of 32 weights


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with a weight kept quantized: int4 (``qweight [N, K/2]``, ``scales``,
    ``offsets [N, K/32]``) or int8 (``qweight [N, K]``, ``scales``). Buffers, not parameters:
    nothing here is trainable, and they bind by name at ``load_weights`` like any tensor."""

    def __init__(
        self, fmt: str, tensors: Dict[str, torch.Tensor], in_features: int, out_features: int, source_type: str
    ):
        super().__init__()
        self.fmt, self.in_features, self.out_features, self.source_type = (fmt, in_features, out_features, source_type)
        self.group_size = GROUP
        for name, t in tensors.items():
            self.register_buffer(name, t)

    @property
    def num_weights(self) -> int:
        """Logical weights of the matrix (what an ``nn.Linear`` would count as parameters)."""
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.workbench
        if self.fmt == "int4":
            return ops.torch_int4_linear(x, self.qweight, self.scales, self.offsets, self.group_size)
        return ops.torch_int8_linear(x, self.qweight, self.scales, self.group_size)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt} ({self.source_type}, group {self.group_size})"


class QuantizedEmbedding(nn.Module):
    qweight: torch.Tensor  # buffers
    scales: torch.Tensor
    """``nn.Embedding`` over an int8 table (GGUF Q8_0): a lookup dequantizes only the rows it reads."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, source_type: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.source_type, self.group_size = source_type, GROUP
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @property
    def num_weights(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.workbench.torch_int8_embedding(ids, self.qweight, self.scales, self.group_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 ({self.source_type}, group {self.group_size})"


def _rows(a: np.ndarray, order: Optional[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a[order] if order is not None else a))


def _quantized_tensors(t: GGUFTensor, order: Optional[np.ndarray]) -> Tuple[str, Dict[str, torch.Tensor]]:
    """(format, tensors) of a Q4_0/Q4_1/Q8_0 matrix in the canonical ops' layout, rows reordered."""
    if t.ggml_type == "Q4_1":
        q, d, m = split_q4_1(t)
        return "int4", {"qweight": _rows(q, order), "scales": _rows(d, order), "offsets": _rows(m, order)}
    if t.ggml_type == "Q4_0":
        q, d = split_q4_0(t)
        return "int4", {
            "qweight": _rows(q, order),
            "scales": _rows(d, order),
            "offsets": _rows((d.astype(np.float32) * -8).astype(np.float16), order),
        }
    q, d = split_q8_0(t)
    return "int8", {"qweight": _rows(q, order), "scales": _rows(d, order)}


def _row_order(name: str, rows: int, config) -> Optional[np.ndarray]:
    if name.endswith("self_attn.q_proj.weight"):
        return qk_row_order(rows, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return qk_row_order(rows, config.num_key_value_heads)
    return None


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    owner_path, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(owner_path) if owner_path else model, leaf, module)


QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def load_gguf_model(file: Path | GGUFFile, weights: GGUFWeights = "keep", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for a llama GGUF file (a path, or the file already parsed); see the module
    docstring. ``dtype`` applies to the unquantized tensors (norms, and every weight under ``dequantize``)."""
    from .build import build_on_meta
    from .gguf_tokenizer import tokenizer_from_gguf

    if weights not in ("keep", "dequantize"):
        raise ValueError(f"gguf weights must be 'keep' or 'dequantize', got {weights!r}")
    f = file if isinstance(file, GGUFFile) else GGUFFile(file)
    path = f.path
    config = llama_config_from_gguf(f)
    tokenizer = tokenizer_from_gguf(f)
    model = build_on_meta(config)
    config.architectures = [type(model).__name__]  # as transformers records it when it loads a model
    shared: Dict[str, nn.Module] = {}  # embedding table -> its quantized module (the tied LM head reuses it)
    unmapped = []
    for t in f.tensors.values():
        name = hf_name(t.name)
        if name is None:
            unmapped.append(t.name)
            continue
        module_path, _, leaf = name.rpartition(".")
        order = _row_order(name, t.shape[0], config)
        if weights == "keep" and t.ggml_type in QUANTIZED_TYPES and leaf == "weight" and len(t.shape) == 2:
            fmt, tensors = _quantized_tensors(t, order)
            if isinstance(model.get_submodule(module_path), nn.Embedding):
                if fmt != "int8":
                    raise NotImplementedError(
                        f"{path.name}: embedding {t.name} is {t.ggml_type}; quantized "
                        "embeddings are supported for Q8_0 only (load with weights='dequantize')"
                    )
                module: nn.Module = QuantizedEmbedding(tensors["qweight"], tensors["scales"], t.ggml_type)
            else:
                module = QuantizedLinear(fmt, tensors, t.shape[1], t.shape[0], t.ggml_type)
            _set_submodule(model, module_path, module)
            shared[module_path] = module
            f.release(t)  # copied into the module's tensors: the mapped bytes are not needed
            continue
        value = torch.from_numpy(dequantize(t)[order] if order is not None else dequantize(t)).to(dtype)
        owner = model.get_submodule(module_path)
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        f.release(t)
    if config.tie_word_embeddings:
        embed = "model.embed_tokens"
        if embed in shared:
            head = shared[embed]
            assert isinstance(head, QuantizedEmbedding)  # the embedding table's quantized module
            model.lm_head = QuantizedLinear(
                "int8",
                {"qweight": head.qweight, "scales": head.scales},
                head.embedding_dim,
                head.num_embeddings,
                head.source_type,
            )
        else:
            model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]  # nn.Module's __getattr__ stub
    _rebuild_rotary(model, config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(
            f"{path.name}: no tensor in the file for {left[:5]} ({len(left)} in all); "
            f"unused file tensors: {unmapped[:5]}"
        )
    del f  # every tensor above is a copy: the memory map closes once the caller drops the file too
    return model, tokenizer


def _rebuild_rotary(model: nn.Module, config) -> None:
    """Rotary modules hold non-persistent buffers computed at construction (``inv_freq``), which a
    meta build leaves empty: construct them again on CPU from the config."""
    for path, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and any(b.is_meta for b in module.buffers()):
            _set_submodule(model, path, type(module)(config=config))


__all__ = ["QuantizedLinear", "QuantizedEmbedding", "load_gguf_model", "GGUFWeights", "QUANTIZED_TYPES"]
