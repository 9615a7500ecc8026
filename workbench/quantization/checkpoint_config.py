"""A checkpoint's quantization config, read from where checkpoints keep it, and written back.

Two places, several spellings, one ``QuantConfig``:

* ModelOpt's ``hf_quant_config.json`` next to the weights::

      {"producer": {...}, "quantization": {"quant_algo": "FP8" | "NVFP4" | "W4A16_AWQ" | ...,
       "kv_cache_quant_algo": null | "FP8", "group_size": 16, "exclude_modules": ["lm_head", ...]}}

* ``config.json``'s ``quantization_config``, by ``quant_method``:

  ==============  ============================================================================
  ``modelopt``    the ModelOpt fields above, flat or under ``"quantization"``
  ``fp8``         HF fine-grained FP8 (``weight_block_size`` [128, 128]) -> ``FP8_BLOCK``;
                  without ``weight_block_size``: per-tensor ``FP8``
  ``gptq``        ``W4A16_GPTQ`` (``bits`` 4, ``group_size``, ``sym``, ``desc_act``)
  ``awq``         ``W4A16_AWQ`` (``group_size`` / ``q_group_size``, ``zero_point``)
  ``mxfp4``       ``MXFP4`` (gpt-oss: MoE experts in ``_blocks`` / ``_scales``)
  ==============  ============================================================================

Modules kept unquantized come as ``exclude_modules`` (ModelOpt), ``modules_to_not_convert`` (HF)
or ``ignore`` (compressed-tensors style); all three are honoured, merged in that order.
``QuantConfig.is_excluded(name)`` reads them as ``fnmatch`` patterns; a pattern without wildcards
also matches as a dotted path component (``"lm_head"``, ``"gate"`` matches
``model.layers.0.mlp.gate`` but not ``...gate_proj``): HF's short names keep working.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

QUANT_ALGOS = ("FP8", "FP8_BLOCK", "NVFP4", "MXFP4", "W4A16_AWQ", "W4A16_GPTQ")
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG_JSON = "config.json"
# Where write_quant_config puts each algorithm by default: ModelOpt's file for ModelOpt's formats,
# config.json's quantization_config for the HF-native ones.
MODELOPT_ALGOS = ("FP8", "NVFP4", "W4A16_AWQ")
DEFAULT_GROUP_SIZE = {"NVFP4": 16, "MXFP4": 32, "W4A16_AWQ": 128, "W4A16_GPTQ": 128}
_EXCLUDE_FIELDS = ("exclude_modules", "modules_to_not_convert", "ignore")


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint was quantized (what the ``*_from_config`` transforms read).

    ``group_size``: elements per scale along the input dim (NVFP4 16, MXFP4 32, AWQ/GPTQ groups);
    ``weight_block_size``: FP8_BLOCK's (rows, cols) tile; ``bits``/``sym``/``desc_act``: GPTQ's;
    ``source``: the file and field it came from; ``raw``: that field as read (nothing dropped).
    """

    quant_algo: str
    group_size: Optional[int] = None
    weight_block_size: Optional[Tuple[int, int]] = None
    exclude_modules: Tuple[str, ...] = ()
    kv_cache_quant_algo: Optional[str] = None
    bits: Optional[int] = None
    sym: Optional[bool] = None
    desc_act: Optional[bool] = None
    source: str = field(default="", compare=False)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.quant_algo not in QUANT_ALGOS:
            raise ValueError(f"quant_algo {self.quant_algo!r} is not supported; supported: {', '.join(QUANT_ALGOS)}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size must be a positive int (or None), got {self.group_size!r}")
        if self.weight_block_size is not None:
            block = tuple(self.weight_block_size)
            if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
                raise ValueError(
                    f"weight_block_size must be two positive ints (rows, cols), got {self.weight_block_size!r}"
                )
            object.__setattr__(self, "weight_block_size", block)
        if self.quant_algo == "FP8_BLOCK" and self.weight_block_size is None:
            raise ValueError(
                "FP8_BLOCK needs weight_block_size (e.g. [128, 128]), the tile one weight_scale_inv covers"
            )
        if self.quant_algo in ("W4A16_AWQ", "W4A16_GPTQ"):
            if self.bits not in (None, 4):
                raise ValueError(
                    f"{self.quant_algo} is 4-bit; this checkpoint says bits={self.bits} (only 4 is supported)"
                )
            object.__setattr__(self, "bits", 4)
        if self.quant_algo == "W4A16_GPTQ":  # GPTQ's own defaults, so that read(write(cfg)) == cfg
            object.__setattr__(self, "sym", True if self.sym is None else bool(self.sym))
            object.__setattr__(self, "desc_act", bool(self.desc_act))
        if isinstance(self.exclude_modules, str):
            raise TypeError("exclude_modules must be a list of patterns, not one string")
        object.__setattr__(self, "exclude_modules", tuple(str(p) for p in self.exclude_modules))

    @property
    def block_size(self) -> Optional[int]:
        """Elements per scale along the input dim: ``group_size`` or the format's default."""
        return self.group_size or DEFAULT_GROUP_SIZE.get(self.quant_algo)

    def is_excluded(self, name: str) -> bool:
        """Whether module ``name`` (checkpoint naming, e.g. ``model.layers.0.mlp.gate``) stays unquantized."""
        return module_matches(name, self.exclude_modules)

    def with_excluded(self, *patterns: str) -> "QuantConfig":
        return replace(self, exclude_modules=self.exclude_modules + tuple(patterns))


def module_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` matches any of ``patterns`` (the ``is_excluded`` rule: fnmatch on the
    name or a parent of it; a pattern without wildcards also as a dotted path component)."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
            return True
        if not any(ch in pattern for ch in "*?[") and f".{pattern}." in f".{name}.":
            return True
    return False


def _excludes(fields: Mapping[str, Any]) -> Tuple[str, ...]:
    out: List[str] = []
    for key in _EXCLUDE_FIELDS:
        value = fields.get(key) or ()
        if isinstance(value, str):
            value = [value]
        out.extend(str(v) for v in value if str(v) not in out)
    return tuple(out)


def _int_or_none(value: Any, what: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return value


def _from_modelopt(q: Mapping[str, Any], source: str) -> QuantConfig:
    algo = q.get("quant_algo")
    if algo is None:
        raise ValueError(f"{source}: no quant_algo (expected one of {', '.join(QUANT_ALGOS)})")
    algo = str(algo).upper()
    block = q.get("weight_block_size")
    if algo == "FP8_BLOCK" and block is None and q.get("group_size"):
        block = (q["group_size"], q["group_size"])
    return QuantConfig(
        quant_algo=algo,
        group_size=_int_or_none(q.get("group_size"), f"{source}: group_size"),
        weight_block_size=tuple(block) if block is not None else None,
        exclude_modules=_excludes(q),
        kv_cache_quant_algo=q.get("kv_cache_quant_algo"),
        source=source,
        raw=dict(q),
        sym=(not q["has_zero_point"]) if "has_zero_point" in q else None,
    )


def _from_hf(q: Mapping[str, Any], source: str) -> QuantConfig:
    method = str(q.get("quant_method", "")).lower()
    common: Dict[str, Any] = dict(
        exclude_modules=_excludes(q), source=source, raw=dict(q), kv_cache_quant_algo=q.get("kv_cache_quant_algo")
    )
    if method == "modelopt":
        inner = q.get("quantization", q)
        cfg = _from_modelopt({**inner, **{k: q[k] for k in _EXCLUDE_FIELDS if k in q and k not in inner}}, source)
        return replace(cfg, raw=dict(q))
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return QuantConfig("FP8", **common)
        return QuantConfig("FP8_BLOCK", weight_block_size=tuple(block), **common)
    if method == "gptq":
        group = _int_or_none(q.get("group_size", 128), f"{source}: group_size")
        return QuantConfig(
            "W4A16_GPTQ",
            group_size=None if group == -1 else group,
            bits=_int_or_none(q.get("bits", 4), f"{source}: bits"),
            sym=bool(q.get("sym", True)),
            desc_act=bool(q.get("desc_act", False)),
            **common,
        )
    if method == "awq":
        group = _int_or_none(q.get("group_size", q.get("q_group_size", 128)), f"{source}: group_size")
        bits = _int_or_none(q.get("bits", q.get("w_bit", 4)), f"{source}: bits")
        if bits != 4:
            raise ValueError(f"{source}: AWQ with bits={bits}; only 4-bit AWQ (W4A16_AWQ) is supported")
        return QuantConfig("W4A16_AWQ", group_size=group, bits=bits, sym=not q.get("zero_point", False), **common)
    if method == "mxfp4":
        return QuantConfig("MXFP4", group_size=32, **common)
    raise ValueError(
        f"{source}: quant_method {q.get('quant_method')!r} is not supported; supported: "
        "modelopt, fp8, gptq, awq, mxfp4 (or a ModelOpt hf_quant_config.json)"
    )


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or re-export the checkpoint") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _hf_quantization_config(hf_config: Any) -> Optional[Mapping[str, Any]]:
    q = (
        hf_config.get("quantization_config")
        if isinstance(hf_config, Mapping)
        else getattr(hf_config, "quantization_config", None)
    )
    if q is None:
        return None
    if hasattr(q, "to_dict"):
        q = q.to_dict()
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {type(q).__name__}")
    return q


def read_quant_config(model_dir: Union[str, Path, None] = None, hf_config: Any = None) -> Optional[QuantConfig]:
    """The quantization config of a checkpoint, or None when it has none.

    Looks at ``<model_dir>/hf_quant_config.json`` (ModelOpt) first, then ``quantization_config`` of
    ``hf_config`` (a ``PretrainedConfig`` or a dict) or of ``<model_dir>/config.json``. Raises
    ``ValueError`` for a config it cannot read (bad JSON, unknown method or algorithm).
    """
    if model_dir is None and hf_config is None:
        raise ValueError("read_quant_config needs model_dir or hf_config")
    directory = Path(model_dir) if model_dir is not None else None
    if directory is not None and (directory / HF_QUANT_CONFIG).is_file():
        path = directory / HF_QUANT_CONFIG
        data = _read_json(path)
        q = data.get("quantization", data)
        if not isinstance(q, Mapping):
            raise ValueError(f"{path}: 'quantization' must be an object")
        return _from_modelopt(q, f"{path.name}: quantization")
    if hf_config is None and directory is not None and (directory / CONFIG_JSON).is_file():
        hf_config = _read_json(directory / CONFIG_JSON)
    if hf_config is None:
        return None
    q = _hf_quantization_config(hf_config)
    return _from_hf(q, f"{CONFIG_JSON}: quantization_config") if q is not None else None


def _modelopt_fields(cfg: QuantConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = {"quant_algo": cfg.quant_algo, "kv_cache_quant_algo": cfg.kv_cache_quant_algo}
    if cfg.group_size is not None:
        out["group_size"] = cfg.group_size
    if cfg.weight_block_size is not None:
        out["weight_block_size"] = list(cfg.weight_block_size)
    if cfg.quant_algo == "W4A16_AWQ" and cfg.sym is not None:
        out["has_zero_point"] = not cfg.sym
    out["exclude_modules"] = list(cfg.exclude_modules)
    return out


def _hf_fields(cfg: QuantConfig) -> Dict[str, Any]:
    excluded = {"modules_to_not_convert": list(cfg.exclude_modules)} if cfg.exclude_modules else {}
    if cfg.quant_algo == "FP8_BLOCK":
        assert cfg.weight_block_size is not None  # an FP8_BLOCK config has one
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(cfg.weight_block_size),
            **excluded,
        }
    if cfg.quant_algo == "W4A16_GPTQ":
        return {
            "quant_method": "gptq",
            "bits": cfg.bits or 4,
            "group_size": cfg.group_size or -1,
            "sym": True if cfg.sym is None else cfg.sym,
            "desc_act": bool(cfg.desc_act),
            **excluded,
        }
    if cfg.quant_algo == "MXFP4":
        return {"quant_method": "mxfp4", **excluded}
    return {"quant_method": "modelopt", **_modelopt_fields(cfg)}


def write_quant_config(model_dir: Union[str, Path], cfg: QuantConfig, where: str = "auto") -> Path:
    """Write ``cfg`` where checkpoints of its kind keep it; returns the file written.

    ``where``: ``"hf_quant_config"`` (ModelOpt's file), ``"config"`` (``config.json``'s
    ``quantization_config``, which must exist already: save the model first) or ``"auto"``
    (ModelOpt's file for FP8 / NVFP4 / W4A16_AWQ, ``config.json`` for FP8_BLOCK, GPTQ, MXFP4).
    ``read_quant_config`` reads back an equal config.
    """
    if where not in ("auto", "hf_quant_config", "config"):
        raise ValueError(f"where must be 'auto', 'hf_quant_config' or 'config', got {where!r}")
    directory = Path(model_dir)
    if where == "auto":
        where = "hf_quant_config" if cfg.quant_algo in MODELOPT_ALGOS else "config"
    if where == "hf_quant_config":
        if cfg.quant_algo not in MODELOPT_ALGOS + ("FP8_BLOCK",):
            raise ValueError(f"{cfg.quant_algo} checkpoints keep their config in config.json (where='config')")
        path = directory / HF_QUANT_CONFIG
        path.write_text(
            json.dumps({"producer": {"name": "workbench"}, "quantization": _modelopt_fields(cfg)}, indent=2) + "\n"
        )
        return path
    path = directory / CONFIG_JSON
    if not path.is_file():
        raise ValueError(f"{path} does not exist: save the model (config.json) before writing its quantization_config")
    data = _read_json(path)
    data["quantization_config"] = _hf_fields(cfg)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


__all__ = ["QuantConfig", "QUANT_ALGOS", "read_quant_config", "write_quant_config", "module_matches", "HF_QUANT_CONFIG"]
