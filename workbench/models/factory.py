"""``load_model(spec)``: the one entry point notebooks and pipelines use to get a model.

Never touches the network: every transformers/huggingface_hub call gets
``local_files_only=True`` and runs with ``HF_HUB_OFFLINE=1`` set for its duration only
(restored afterwards, so importing or calling this leaves no global state behind).
Nothing is cached between calls either: loading ``smollm2`` twice parses the GGUF twice
(slow, ~15-20 s on 2 cores, but predictable) - keep the ``LoadedModel`` if you need it again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .build import build_random_model
from .dtypes import resolve_dtype
from .loaded import LoadedModel
from .spec import ModelSpecError, ResolvedSpec, resolve_spec
from .tiny import build_tiny_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """Set HF_HUB_OFFLINE=1 for the duration of the block, then restore the old value."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def _placement(device: torch.device) -> dict:
    # from_pretrained loads onto CPU by default; device_map puts weights straight on an
    # accelerator instead of allocating a CPU copy first.
    return {} if device.type == "cpu" else {"device_map": {"": str(device)}}


def _finalise(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device):
    """Config, weights and tokenizer (+ chat template) all come from one GGUF file.

    ``GgufConfig(dequantize=True)``: transformers 5 can keep GGUF weights packed in
    ``GgufLinear`` modules when the optional ``kernels`` package has a matmul kernel for
    the device; the workbench wants plain ``nn.Linear`` graphs everywhere, so we always
    ask for dense weights. The loaded model still carries a ``GgufHfQuantizer`` and
    ``config.quantization_config`` (``is_quantized`` is True, ``save_pretrained``
    refuses); once we have checked no packed module is left, we drop that marker.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kw = dict(gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kw, **_placement(device)
    )
    packed = [n for n, m in model.named_modules() if type(m).__name__.startswith("Gguf")]
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not packed:
        quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    return model, tokenizer


def _load_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True, **_placement(device))
    tokenizer = None
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def load_model(
    spec: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    tiny_registry: Mapping | None = None,
) -> LoadedModel:
    """Load the model named by ``spec`` (see ``workbench.models.spec`` for the forms).

    ``seed`` only matters for ``tiny:<arch>`` (random weights); ``tiny_registry`` lets you
    resolve ``tiny:`` names against your own registry instead of the default one.
    Raises :class:`ModelSpecError` for specs that cannot be resolved or loaded.
    """
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    resolved: ResolvedSpec = resolve_spec(spec, tiny_registry)
    tokenizer = None
    with hf_offline():
        if resolved.kind == "tiny":
            config = build_tiny_config(resolved.arch, tiny_registry)
            model = build_random_model(config, dtype, device, seed)
            source = f"random init (seed={seed})"
        else:
            try:
                if resolved.kind == "gguf":
                    model, tokenizer = _load_gguf(resolved.path, dtype, device)
                else:
                    model, tokenizer = _load_hf_dir(resolved.path, dtype, device)
            except (OSError, ValueError, KeyError) as exc:
                raise ModelSpecError(f"{spec!r} resolved to {resolved.path} but loading failed: {exc}") from exc
            source = str(resolved.path)
    model = _finalise(model)
    return LoadedModel(spec=spec, model=model, config=model.config, tokenizer=tokenizer, source=source)
