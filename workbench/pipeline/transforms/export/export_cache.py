"""The exported graph kept on disk, so a repeat run of the same model and config does not trace again.

``export_to_gm`` on smollm2 is ~1.8-3 s of a CPU run's first answer (torch.export's non-strict trace
of the model cut to three layers, then the layer stamping); a second process exporting the same
model with the same code and config gets the same graph. The graph is meta-traced
(``trace_device: meta``): it holds no weight values, so what is kept is its structure, as a record
(``graph_record.py``); building the graph back from one took 0.10-0.36 s on smollm2 (5 runs
in one process), against 1.6-2.1 s to export.

Safety: an entry is written only after the graph built back from its record is checked against
the exported one -- node for node, meta for meta, fake value for fake value (sizes compared with the
symbols renamed in order), tensors by name, shape and dtype (``checked_record``). A graph the
format cannot hold (tensors made in the forward, weights traced off meta, see ``graph_record``)
gets no entry, and the transform's details say why. The key covers the workbench's source, torch's
and transformers' versions, the transform's config and bounds, and the traced module: its class,
its repr, its config (private fields such as ``_attn_implementation`` included), every submodule's
plain attributes, and the name, shape and dtype of every tensor. Entries are JSON
(``record_json``): reading one calls nothing the file names, so it cannot run code. A graph still
decides what the model computes, so entries are read only from a directory that nobody else can
write (``cache_dir.untrusted``, as for the C++ kernels).
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ....cache_dir import KeyedFiles
from ...interface import TransformInfo
from ...probe_cache import workbench_source_hash
from . import record_json
from .graph_from_record import module_of
from .graph_record import FORMAT, Uncacheable, describe, record_of

# ------------------------------------------------------------------------------------------ key


def export_key(module: torch.nn.Module, cfg: Any, bounds: Tuple[int, int], vocab_size: int) -> str:
    """What the exported graph depends on: code, versions, config, bounds and the traced module."""
    import transformers

    inner = getattr(module, "model", module)
    config = getattr(inner, "config", None)
    try:
        config_text = config.to_json_string(use_diff=False) if config is not None else ""
    except Exception:  # noqa: BLE001 - a config that does not serialise: its repr
        config_text = repr(config)
    # private config fields too: the attention implementation (``_attn_implementation``) changes the
    # traced ops and is not in the JSON
    config_text += repr(sorted((k, _plain(v)) for k, v in vars(config).items())) if config is not None else ""
    tensors = [
        f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}"
        for kind, items in (("p", module.named_parameters()), ("b", module.named_buffers()))
        for name, t in items
    ]
    parts = [
        f"format {FORMAT}",
        workbench_source_hash(),
        torch.__version__,
        transformers.__version__,
        cfg.model_dump_json(),
        repr(bounds),
        str(vocab_size),
        f"{type(module).__module__}.{type(module).__qualname__}",
        repr(module),
        config_text,
        *tensors,
        *_module_attributes(module),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _plain(value: Any) -> str:
    """``repr`` of plain data; the type of anything else (its repr may hold an address)."""
    if isinstance(value, (type(None), bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_plain(k)}: {_plain(v)}" for k, v in value.items()) + "}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _module_attributes(module: torch.nn.Module) -> List[str]:
    """Every submodule's class and plain attributes (``is_causal``, ``layer_idx``, ``scaling``, a
    sliding window...): forwards branch on them, and not all are in the config or the repr."""
    out = []
    for name, m in module.named_modules():
        attrs = {
            k: v
            for k, v in vars(m).items()
            if k not in ("_parameters", "_buffers", "_modules")
            and not k.endswith("_hooks")
            and not k.startswith("_forward")
            and not k.startswith("_backward")
        }
        out.append(
            f"{name}:{type(m).__module__}.{type(m).__qualname__}:{sorted((k, _plain(v)) for k, v in attrs.items())}"
        )
    return out


class ExportCache:
    """``$WORKBENCH_CACHE_DIR/exports/<key>.json``: one exported graph per file (``cache_dir.KeyedFiles``:
    written atomically, the directory kept within ``MAX_BYTES``, least recently used first)."""

    MAX_BYTES = 512 << 20  # smollm2's entry is ~1 MB

    def __init__(self) -> None:
        self.files = KeyedFiles("exports", ".json", self.MAX_BYTES, trusted="each is a graph the model runs")

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        data = self.files.read(key)
        if data is None:
            return None
        try:
            record = record_json.loads(data)
        except Exception:  # noqa: BLE001 - any malformed entry (JSON, tags, values): export again
            return None
        if not (isinstance(record, dict) and record.get("format") == FORMAT):
            return None
        self.files.used(key)
        return record

    def put(self, key: str, data: bytes) -> Optional[str]:
        """Write a record (``checked_record``); returns why not when it cannot be written (a
        read-only cache only costs the trace). Entries of the pickle format before it are removed."""
        why = self.files.write(key, data)
        if why is None and self.files.dir is not None:
            for old in self.files.dir.glob("*.pkl"):
                old.unlink(missing_ok=True)
        return why


def checked_record(gm: fx.GraphModule, info: TransformInfo) -> bytes:
    """``record_of(gm, info)`` as JSON (``record_json``), after checking that the graph built back
    from those bytes is ``gm``'s."""
    data = record_json.dumps(record_of(gm, info))
    back, _ = module_of(record_json.loads(data))
    want, got = describe(gm), describe(back)
    if want != got:
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise Uncacheable(f"the graph built back from the record differs at entry {first}")
    return data


def read_graph(cache: Optional[ExportCache], key: str) -> Tuple[Optional[Tuple[fx.GraphModule, TransformInfo]], str]:
    """(the graph and report kept under ``key``, "") on a hit, else (None, what the details will say)."""
    record = cache.get(key) if cache is not None else None
    if record is None:
        return None, "off" if cache is None else "no entry: exported"
    try:
        gm, info = module_of(record)
    except Exception as e:  # noqa: BLE001 - an entry that no longer builds (an op gone): export again
        return None, f"an entry was found but did not build ({type(e).__name__}: {e}); exported again"
    info.details["export_cache"] = f"read ({key[:12]}); export's input guards are not kept"
    info.details["summary"] += " -- read from the export cache"
    return (gm, info), ""


def store_graph(cache: ExportCache, key: str, gm: fx.GraphModule, info: TransformInfo, made, note: str) -> str:
    """Write ``gm`` to the export cache (after checking it builds back the same); says what happened."""
    if made:
        return f"{note}; not kept: tensors made in the forward ({len(made)})"
    try:
        data = checked_record(gm, info)
    except Uncacheable as e:
        return f"{note}; not kept: {e}"
    except Exception as e:  # noqa: BLE001 - a cache that cannot build its record never fails the export
        return f"{note}; not kept: building the record failed ({type(e).__name__}: {str(e)[:200]})"
    why = cache.put(key, data)
    return f"{note}; {why}" if why else f"{note}; written ({key[:12]})"


__all__ = [
    "ExportCache",
    "Uncacheable",
    "checked_record",
    "describe",
    "export_key",
    "module_of",
    "read_graph",
    "record_of",
    "store_graph",
]
