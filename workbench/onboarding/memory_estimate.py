"""Will an entry fit? The weight bytes of a registry entry, estimated before anything is loaded.

``workbench check`` loads each model in float32, runs the whole pipeline and generates. Loading a
model that cannot fit takes minutes and then dies in the OOM killer (no row, no report), so each
entry is sized first, from what can be read without loading (the reference's onboarding starts
with this check):

* ``tiny:<arch>``: the config built on the meta device (no storage), its parameters counted;
* an HF directory: the safetensors headers (shapes only; ``.bin`` files are counted by size);
* a GGUF file (``smollm2`` too): the tensor shapes in its header.

The check then needs about ``PEAK_FACTOR`` times the float32 weights: the eager model the probes
and HF's reference run, plus the fused copies the ``post_load_fusion`` stage concatenates (Q/K/V
and gate/up: most of a decoder's weights) while the originals are still referenced by earlier
snapshots. Caches and activations of the check's few short prompts are small beside that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch

FP32_BYTES = 4
# eager weights + the fused copies of post_load_fusion; see the module docstring
PEAK_FACTOR = 2.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def weight_elements(spec: str, tiny_registry=None) -> Tuple[int, str]:
    """(number of weight elements, how it was counted) of the model ``spec`` names, read without
    loading any weight. Raises ``ModelSpecError`` for a spec that does not resolve."""
    from ..models.spec import resolve_spec

    resolved = resolve_spec(spec, tiny_registry)
    if resolved.kind == "tiny":
        from ..models.build import build_on_meta
        from ..models.tiny import build_tiny_config

        assert resolved.arch is not None
        model = build_on_meta(build_tiny_config(resolved.arch, tiny_registry))
        seen = {id(p): p.numel() for p in [*model.parameters(), *model.buffers()]}
        return sum(seen.values()), "config on the meta device"
    assert resolved.path is not None
    if resolved.kind == "gguf":
        from ..models.gguf_file import GGUFFile

        tensors = GGUFFile(resolved.path).tensors  # name -> GGUFTensor
        return sum(int(torch.Size(t.shape).numel()) for t in tensors.values()), "GGUF header"
    return _hf_dir_elements(resolved.path)


def _hf_dir_elements(directory: Path) -> Tuple[int, str]:
    from safetensors import safe_open

    total, bin_bytes = 0, 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            total += sum(int(torch.Size(st.get_slice(k).get_shape()).numel()) for k in st.keys())
    for f in sorted(directory.glob("*.bin")):
        bin_bytes += f.stat().st_size
    # a .bin checkpoint is read by its size: at least one element per 2 bytes (fp16/bf16 storage)
    return total + bin_bytes // 2, "safetensors headers" + (" and .bin sizes" if bin_bytes else "")


def memory_refusal(spec: str, device: torch.device, copies: int = 1, tiny_registry=None) -> Tuple[Optional[str], str]:
    """(why the entry cannot fit on ``device``, or None; a one-line estimate for the report).

    The estimate is ``PEAK_FACTOR`` x the float32 weight bytes (x ``copies``: the ranks of a
    world-size-N entry on one machine each load the whole model) against the memory available now
    (``torch.cuda.mem_get_info`` on a GPU, psutil's available RAM on a CPU)."""
    from ..pipeline.transforms.caches.memory import available_memory

    elements, how = weight_elements(spec, tiny_registry)
    weights = elements * FP32_BYTES
    need = int(weights * PEAK_FACTOR * copies)
    have = available_memory(device)
    ranks = f" x {copies} ranks" if copies > 1 else ""
    line = f"needs ~{_gib(need)} ({_gib(weights)} of float32 weights, from the {how}, x{PEAK_FACTOR:g}{ranks})"
    if have is None:
        return None, f"{line}; free memory on {device} not known"
    free, where = have
    line += f"; {_gib(free)} {where}"
    if need > free:
        return (
            f"does not fit: the check needs ~{_gib(need)} on {device} ({_gib(weights)} of float32 weights x"
            f"{PEAK_FACTOR:g} for the eager model and the fused copies{ranks}), {_gib(free)} {where}. Free memory, "
            "or check a smaller model (a tiny:<arch> of the same family)",
            line,
        )
    return None, line


__all__ = ["FP32_BYTES", "PEAK_FACTOR", "memory_refusal", "weight_elements"]
