"""Numerics probe results kept on disk, so a repeat run of the same model and config does not run
the probe forwards again (``workbench run`` turns it on; ``PipelineStepper(probe_cache=True)``).

On smollm2 the 20 probes (2 x 16 tokens through each changed graph) are ~3 s of an ~11 s first
answer; a second ``workbench run`` of the same model computes the same graphs from the same weights
and gets the same numbers. A result is reused only when everything it depends on is the same, in
one key per step:

- the eager model's reference logits on the probe batch, bit for bit (a fingerprint of the weights
  and the model's code; computed anyway, it is what every probe compares with), and the probe batch;
- the graph: every node's name, op, target, arguments (``graph_structure``: what its code is
  generated from);
- the config of every transform up to this one, and the source of the transforms' classes (the
  workbench's own files are hashed once per process: ``.py``, ``.cpp``, ``.h``, ``.yaml``);
- torch's and transformers' versions, the device, the dtype and torch's thread count (a GEMM's
  reduction order).

Only probes that ran are stored (a failed probe fails its step and is never reused), and a key that
cannot be formed (a transform whose source cannot be read, a module that is not a GraphModule) means
the probe runs as before. ``$WORKBENCH_CACHE_DIR`` set to ``off`` switches this off with the other
caches.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..cache_dir import KeyedFiles
from .numerics import Numerics

_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".yaml")
_PACKAGE = Path(__file__).resolve().parents[1]  # workbench/


@functools.lru_cache(maxsize=1)
def workbench_source_hash() -> str:
    """One hash of every source file of the workbench package (kernels and default config included)."""
    h = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _class_source_hash(cls: type) -> Optional[str]:
    """The hash of the file defining ``cls`` ("" inside the workbench package, which
    ``workbench_source_hash`` covers), or None when it cannot be read."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None or not os.path.isfile(path):
        return None
    if Path(path).resolve().is_relative_to(_PACKAGE):
        return ""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def transform_source_key(transform_classes: Sequence[type]) -> Optional[str]:
    """The hash of the files defining transform classes outside the workbench package (a user's or a
    test's), or None when one cannot be read: then nothing is reused."""
    parts = [_class_source_hash(cls) for cls in transform_classes]
    if any(p is None for p in parts):
        return None
    return hashlib.sha256("\0".join(p for p in parts if p).encode()).hexdigest()


def _tensor_hash(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_key(reference: torch.Tensor, probe_args: Sequence[Any], device: torch.device, dtype: torch.dtype) -> str:
    """What every step of this run shares: the reference logits, the probe batch, the code and the
    environment."""
    import transformers

    parts = [
        _tensor_hash(reference),
        *(_tensor_hash(a) if isinstance(a, torch.Tensor) else repr(a) for a in probe_args),
        workbench_source_hash(),
        torch.__version__,
        transformers.__version__,
        str(device),
        str(dtype),
        str(torch.get_num_threads()),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


NodeTexts = Dict[torch.fx.Node, Tuple[str, str, Any, Any, Any, str]]


def graph_structure(module: torch.fx.GraphModule, texts: Optional[NodeTexts] = None) -> str:
    """Every node of ``module``'s graph and of the graphs of its GraphModule submodules: name, op,
    target, args, kwargs -- what its generated code is made from. Reading ``module.code`` instead
    would make a lazily recompiled graph generate its code now (~50 ms for smollm2's 2,000 nodes,
    the work a probe read from the cache does not otherwise need).

    ``texts``: each node's line from an earlier call, reused while the node keeps its name and op
    and the same target, args and kwargs objects (fx assigns new tuples whenever a node's arguments
    change). A pipeline formats each node once instead of once per step (~15 ms a step
    on smollm2)."""
    parts = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.fx.GraphModule):
            parts.append(f"# {name}")
            parts.extend(_node_text(n, texts) for n in sub.graph.nodes)
    return "\n".join(parts)


def _node_text(n: torch.fx.Node, texts: Optional[NodeTexts]) -> str:
    if texts is not None:
        known = texts.get(n)
        if (
            known is not None
            and known[0] == n.name
            and known[1] == n.op
            and known[2] is n.target
            and known[3] is n.args
            and known[4] is n.kwargs
        ):
            return known[5]
    text = f"{n.name}={n.op}:{n.target}{n.args}{n.kwargs}"
    if texts is not None:
        texts[n] = (n.name, n.op, n.target, n.args, n.kwargs, text)
    return text


def step_key(
    base: str, configs: Sequence[Any], sources: str, module: torch.nn.Module, texts: Optional[NodeTexts] = None
) -> Optional[str]:
    """The key of one step: ``base`` (``run_key``), the configs of the transforms so far, their
    sources (``transform_source_key``) and the graph (``graph_structure``, ``texts`` its memo); None
    for a module that is not a graph."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    dumped = [c.model_dump_json() if hasattr(c, "model_dump_json") else repr(c) for c in configs]
    structure = graph_structure(module, texts)
    return hashlib.sha256("\0".join([base, *dumped, sources, structure]).encode()).hexdigest()


class ProbeCache:
    """``$WORKBENCH_CACHE_DIR/probes/<key>.json``: one probe result per file (``cache_dir.KeyedFiles``:
    written atomically, the directory kept within ``MAX_BYTES``, least recently used first)."""

    MAX_BYTES = 64 << 20  # ~16,000 results of one 4 KiB block each; a smollm2 run writes 19-20

    def __init__(self) -> None:
        self.files = KeyedFiles("probes", ".json", self.MAX_BYTES)

    def get(self, key: str) -> Optional[Numerics]:
        data = self.files.read(key)
        if data is None:
            return None
        try:
            parsed = json.loads(data)
            numerics = Numerics(
                max_abs=float(parsed["max_abs"]),
                rmse_ratio=float(parsed["rmse_ratio"]),
                top1_agreement=float(parsed["top1_agreement"]),
                from_cache=True,
            )
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: the probe runs
        self.files.used(key)
        return numerics

    def put(self, key: str, numerics: Numerics) -> None:
        if not numerics.ok or numerics.from_cache:
            return
        data = {
            "max_abs": numerics.max_abs,
            "rmse_ratio": numerics.rmse_ratio,
            "top1_agreement": numerics.top1_agreement,
        }
        self.files.write(key, json.dumps(data).encode())  # a read-only cache only costs the probes


__all__ = ["NodeTexts", "ProbeCache", "run_key", "step_key", "transform_source_key", "workbench_source_hash"]
