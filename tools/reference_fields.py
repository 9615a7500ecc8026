"""The config fields the reference documents for each transform key, read from its pages.

The reference pages (``../shared/seeds/*.txt``: the transform catalogue) give every key a
``Transform key: <key>`` heading and, where the key has fields beyond the common ``TransformConfig``
ones, a JSON schema after "Show JSON schema". This script reads them and writes
``tests/data/reference_fields.json`` -- ``{key: {field: {"default": ..., "values": [...]}}}`` for the
key-specific fields: the reference default (absent: the field is required) and the documented values
of an enum field -- which ``tests/test_reference_fields.py`` checks every registered transform config against
(the pages are not in the repository, so CI reads the extract).

    python tools/reference_fields.py [--seeds DIR] [--check]

``--check`` prints, per key, the reference fields our config rejects (exit 1 if any), without writing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "reference_fields.json"
COMMON = {
    "stage",
    "run_per_gm",
    "enabled",
    "skip_on_error",
    "run_graph_cleanup",
    "run_shape_prop",
    "requires_clean_graph",
    "requires_shape_prop",
    "debug_visualize_dir",
    "expect_mem_change",
}


def _json_object_at(text: str, start: int) -> Dict[str, Any]:
    """The JSON object whose ``{`` is at ``text[start]`` (brace matching; the pages hold no braces
    inside strings of these schemas)."""
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return json.loads(text[start : end + 1])
    raise ValueError(f"unterminated JSON object at offset {start}")


def _field(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``{"default": ..., "values": [...]}`` of one schema property, each only where documented."""
    out: Dict[str, Any] = {"default": spec["default"]} if "default" in spec else {}
    values = [v for alt in [spec, *spec.get("anyOf", [])] for v in alt.get("enum", [])]
    if values:
        out["values"] = values
    return out


def read_reference(seeds: Path) -> Dict[str, Dict[str, Any]]:
    """``{key: {field: {"default", "values"}}}`` for every documented key (``{}``: only the common fields)."""
    fields: Dict[str, Dict[str, Any]] = {}
    for page in sorted(seeds.glob("*.txt")):
        parts = re.split(r"^Transform key: (\S+)\s*$", page.read_text(), flags=re.M)
        for key, body in zip(parts[1::2], parts[2::2]):
            schema = re.search(r"Show JSON schema\s*\n(\{)", body)
            props = _json_object_at(body, schema.start(1)).get("properties", {}) if schema else {}
            fields[key] = {f: _field(spec) for f, spec in sorted(props.items()) if f not in COMMON}
    return fields


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=Path, default=ROOT.parent / "shared" / "seeds")
    parser.add_argument("--check", action="store_true", help="report rejected fields, write nothing")
    args = parser.parse_args(argv)
    if not args.seeds.is_dir():
        print(f"no reference pages at {args.seeds}: pass --seeds DIR", file=sys.stderr)
        return 2
    reference = read_reference(args.seeds)
    if not args.check:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
        print(f"{len(reference)} keys, {sum(map(len, reference.values()))} key-specific fields -> {OUT}")
        return 0
    sys.path.insert(0, str(ROOT))
    import workbench.pipeline  # noqa: F401  (registers every transform)
    from workbench.pipeline.interface import TRANSFORMS

    bad = 0
    for key, want in reference.items():
        have = TRANSFORMS.get(key).config_class.model_fields if key in TRANSFORMS else {}
        missing = [f for f in want if f not in have]
        if key not in TRANSFORMS or missing:
            bad += 1
            print(f"{key}: " + ("not registered" if key not in TRANSFORMS else f"rejects {missing}"))
    print(f"{len(reference)} keys checked, {bad} short of the reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
