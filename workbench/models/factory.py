"""``load_model(spec)``: the one entry point notebooks and pipelines use to get a model.

Never touches the network: every transformers/huggingface_hub call gets
``local_files_only=True`` and runs with ``HF_HUB_OFFLINE=1`` set for its duration only
(restored afterwards, so importing or calling this leaves no global state behind).
Nothing is cached in memory between calls. A llama-architecture GGUF file (``smollm2``) is read
by our own parser (``gguf_model``: about a second, quantized weights kept or dequantized); any
other GGUF architecture goes through transformers' GGUF support, converted once to a dequantized
safetensors copy on disk (see ``converted_cache_dir``) because that parse takes ~17 s.
When ``workbench.models.custom`` registers a custom canonical-op model for the config's class
(DeepSeek-V3, Qwen3-Next), ``load_model`` also builds it, sharing every tensor with the HF model
(``LoadedModel.export_model``): ``export_to_gm`` traces it and says so in its details, while the HF
model stays ``LoadedModel.model``, the numerics reference. ``custom_models=False`` opts out.
A directory whose config.json disagrees with its weights (a tensor of another shape, layers missing
or left over) is refused, naming both files and the first differing tensor (``config_weights``),
instead of loading with random or dropped weights. A directory holding a quantized checkpoint (ModelOpt
``hf_quant_config.json``, or a supported ``quantization_config`` in ``config.json``) loads as its
dequantized twin, with the raw quantized tensors kept in ``LoadedModel.checkpoint``
(``quantized_checkpoint``): transformers' own quantizers are never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional, Tuple, cast

import torch

from ..cache_dir import cache_root
from .build import auto_class_for, build_random_model
from .config_weights import config_weights_disagreement
from .devices import resolve_device
from .dtypes import resolve_dtype
from .load_checks import check_config, check_finite, check_tokenizer_fits, read_json_files
from .loaded import LoadedModel
from .spec import ModelSpecError, ResolvedSpec, resolve_spec
from .tiny import build_tiny_config

logger = logging.getLogger("workbench.models")

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


def converted_cache_dir(gguf: Path) -> Optional[Path]:
    """Where a dequantized copy of ``gguf`` is kept, or None when the cache is switched off.

    Parsing a GGUF file costs ~17 s for SmolLM2 (three parses plus transformers' per-tensor name
    mapping); loading the same weights from safetensors takes well under a second. The copy lives
    on disk (``$WORKBENCH_CACHE_DIR``, default ``~/.cache/workbench``; set it to ``off`` to disable),
    keyed by file name, size and mtime, so a changed GGUF file is converted again.
    """
    root = cache_root()
    if root is None:
        return None
    st = gguf.stat()
    return root / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}-fp32"


def _load_gguf_cached(path: Path, dtype: torch.dtype, device: torch.device):
    """``_load_gguf`` through the converted fp32 copy; creates the copy on first use."""
    cache = converted_cache_dir(path)
    if cache is not None and (cache / "config.json").is_file():
        model, tokenizer = _load_hf_dir(cache, dtype, device)
        return model, tokenizer, f"{path} (converted copy: {cache})"
    model, tokenizer = _load_gguf(path, torch.float32, torch.device("cpu"))
    if cache is not None:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent if cache.parent.exists() else None))
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            cache.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, cache)  # atomic: a concurrent loader sees all or nothing
        except OSError as e:  # a read-only home must not stop the load
            logger.warning("could not keep a converted copy of %s in %s: %s", path.name, cache, e)
    model = model.to(dtype=dtype, device=device)
    return model, tokenizer, str(path)


def _load_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoTokenizer

    raw = read_json_files(directory, ("config.json",))
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    if "config.json" in raw:
        check_config(directory, raw["config.json"], config)
    auto = auto_class_for(config)
    # Mismatched sizes are let through and the loading info kept, so that a config.json that
    # disagrees with the weights is reported below by file, tensor and shapes (HF raises "You set
    # `ignore_mismatched_sizes` to `False`" for a wrong size, and loads a missing or extra layer
    # with only a printed report: random weights or dropped ones).
    model, info = auto.from_pretrained(
        directory,
        dtype=dtype,
        local_files_only=True,
        ignore_mismatched_sizes=True,
        output_loading_info=True,
        **_placement(device),
    )
    disagreement = config_weights_disagreement(directory, model, info)
    if disagreement:
        raise ModelSpecError(disagreement)
    tokenizer = None
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def _load_quantized_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer, checkpoint) of a quantized checkpoint directory, or None for any other
    directory: the model is the dequantized twin, ``checkpoint`` the quant config and raw tensors
    (``quantized_checkpoint``); transformers' own quantizers are never involved."""
    from ..quantization.checkpoint_config import read_quant_config
    from .quantized_checkpoint import load_quantized_dir

    quant = read_quant_config(directory)
    if quant is None:
        return None
    model, checkpoint = load_quantized_dir(directory, quant, dtype, device)
    tokenizer = None
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer, checkpoint


def _load_failure(spec: str, path: Path, exc: BaseException) -> str:
    """One message for a model that resolved to files but did not load: which file, why, what to do."""
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ == "SafetensorError" or "safetensors" in text.lower():
        bad = sorted(p.name for p in Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
        return (
            f"{spec!r} resolved to {path}, but its weights could not be read ({text}): "
            f"{', '.join(bad) or 'the .safetensors file'} is not a valid safetensors file (truncated, or not "
            "a safetensors file at all). Re-download or re-save the weights (model.save_pretrained)."
        )
    return f"{spec!r} resolved to {path} but loading failed: {text}"


def _load_gguf_file(path: Path, weights: str, dtype: torch.dtype, device: torch.device):
    """A GGUF file: llama-architecture files through our own reader (``gguf_model``: quantized
    weights kept, or dequantized, in about a second); any other architecture through transformers'
    GGUF support (always dequantized; converted once and cached, see ``converted_cache_dir``)."""
    from .gguf_file import GGUFFile

    parsed = GGUFFile(path)
    arch = parsed.metadata.get("general.architecture")
    if arch == "llama":
        from .gguf_model import GGUFWeights, load_gguf_model

        model, tokenizer = load_gguf_model(parsed, cast("GGUFWeights", weights), dtype)  # checked by load_model
        kept = "quantized weights kept" if weights == "keep" else "dequantized to fp32"
        return model.to(device), tokenizer, f"{path} ({kept})"
    del parsed  # the transformers path reads the file itself
    if weights == "keep":
        logger.info("%s: architecture %r has no quantized loader here; loading it dequantized", path.name, arch)
    return _load_gguf_cached(path, dtype, device)


def load_model(
    spec: str,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "auto",
    seed: int = 0,
    *,
    tiny_registry: Mapping | None = None,
    gguf_weights: str = "keep",
    custom_models: bool | Mapping[str, type] = True,
) -> LoadedModel:
    """Load the model named by ``spec`` (see ``workbench.models.spec`` for the forms).

    ``device``: ``"auto"`` (the default) is CUDA when torch sees a GPU, else the CPU; ``dtype``:
    ``"auto"`` (the default) is bfloat16 on CUDA, float32 on the CPU.
    ``seed`` only matters for ``tiny:<arch>`` (random weights); ``tiny_registry`` lets you
    resolve ``tiny:`` names against your own registry instead of the default one.
    ``gguf_weights`` (GGUF files, e.g. ``smollm2``): ``"keep"`` the file's 4/8-bit weights as they
    are (canonical int4/int8 linear ops; the default), or ``"dequantize"`` them to fp32 -- the
    model the quantized one is compared with.
    ``custom_models``: ``True`` builds the custom canonical-op model registered for the config's class
    (``workbench.models.custom.CUSTOM_MODELS``) as ``LoadedModel.export_model`` -- what ``export_to_gm``
    traces -- beside the HF model, sharing its tensors (no second copy of the weights); ``False``
    exports the HF class; a mapping ``{config class name: model class}`` is used as the registry.
    Raises :class:`ModelSpecError` for specs that cannot be resolved or loaded, or whose registered
    custom model cannot stand in for the HF model (the message says to pass ``custom_models=False``).
    """
    if gguf_weights not in ("keep", "dequantize"):
        raise ModelSpecError(
            f"gguf_weights must be 'keep' (quantized weights as stored) or 'dequantize' (fp32), got {gguf_weights!r}"
        )
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolved: ResolvedSpec = resolve_spec(spec, tiny_registry)
    tokenizer = checkpoint = None
    with hf_offline():
        if resolved.kind == "tiny":
            assert resolved.arch is not None  # a tiny spec names its architecture
            config = build_tiny_config(resolved.arch, tiny_registry)
            model = build_random_model(config, dtype, device, seed)
            source = f"random init (seed={seed})"
        else:
            assert resolved.path is not None  # every other kind names a file or directory
            try:
                if resolved.kind == "gguf":
                    model, tokenizer, source = _load_gguf_file(resolved.path, gguf_weights, dtype, device)
                elif (quantized := _load_quantized_hf_dir(resolved.path, dtype, device)) is not None:
                    model, tokenizer, checkpoint = quantized
                    source = (
                        f"{resolved.path} ({checkpoint.config.quant_algo} checkpoint: dequantized to "
                        f"{str(dtype).replace('torch.', '')}, quantized tensors kept)"
                    )
                else:
                    model, tokenizer = _load_hf_dir(resolved.path, dtype, device)
                    source = str(resolved.path)
            except Exception as exc:  # noqa: BLE001 - any loader failure: name the model, the file and what to do
                if isinstance(exc, ModelSpecError):
                    raise
                if resolved.path.is_dir():  # a JSON file that does not parse: named, with line and column
                    read_json_files(resolved.path)
                raise ModelSpecError(_load_failure(spec, resolved.path, exc)) from exc
            check_tokenizer_fits(tokenizer, model, f"{spec!r} ({resolved.path})")
            check_finite(model, f"{spec!r} ({resolved.path})")
    model = _finalise(model)
    export_model, fallback = _custom_export_model(spec, model, custom_models)
    return LoadedModel(
        spec=spec,
        model=model,
        config=model.config,  # type: ignore[arg-type]  # nn.Module's __getattr__ stub: an HF model's config
        tokenizer=tokenizer,
        source=source,
        checkpoint=checkpoint,
        export_model=export_model,
        custom_fallback=fallback,
    )


def _custom_export_model(
    spec: str, model: torch.nn.Module, custom_models: bool | Mapping[str, type]
) -> Tuple[Optional[torch.nn.Module], Optional[str]]:
    """(the registered custom model for ``model``'s config, sharing its tensors, or None; why the
    default registry's model was not used, or None). A custom model that refuses the config (one it
    does not implement, where HF's class runs it) falls back to the HF class with that note, said
    once; a registry the caller passed refuses loudly."""
    if custom_models is False:
        return None, None
    if custom_models is not True and not isinstance(custom_models, Mapping):
        raise ModelSpecError(
            f"custom_models must be True, False or a mapping {{config class name: model class}}, got {custom_models!r}"
        )
    from .custom import CUSTOM_MODELS
    from .custom.loading import CustomModelError, build_export_model

    registry = CUSTOM_MODELS if custom_models is True else custom_models
    try:
        custom = build_export_model(model, registry)
    except CustomModelError as e:
        if custom_models is not True:
            raise ModelSpecError(f"{spec!r}: {e}") from None
        note = f"{e} -- exporting HF's {type(model).__name__} instead"
        logger.warning("%s: %s", spec, note)
        return None, note
    if custom is not None:
        logger.info(
            "%s: exporting custom %s.%s for %s (the HF %s stays the numerics reference; "
            "custom_models=False exports the HF class)",
            spec,
            type(custom).__module__,
            type(custom).__name__,
            type(model.config).__name__,
            type(model).__name__,
        )
    return custom, None
