"""Write a `workbench check` registry whose entries run with ``match_attention_layout.attn_layout``
set to one layout: the default registry's entries, their own overrides kept.

    python tools/check_layout_registry.py bnsd /tmp/registry_bnsd.yaml
    workbench check --registry /tmp/registry_bnsd.yaml --quick

The entries' ``yaml_extra`` paths are made absolute (the registry resolves them against its own
folder, and the written file lives elsewhere)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

DEFAULT = Path(__file__).resolve().parent.parent / "workbench" / "models" / "registry.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=["bsnd", "bnsd"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--registry", type=Path, default=DEFAULT)
    args = parser.parse_args()
    data = yaml.safe_load(args.registry.read_text())
    for entry in data["models"]:
        entry["overrides"] = {**(entry.get("overrides") or {}), "match_attention_layout.attn_layout": args.layout}
        if entry.get("yaml_extra"):
            entry["yaml_extra"] = [str((args.registry.parent / p).resolve()) for p in entry["yaml_extra"]]
    args.out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"{args.out}: {len(data['models'])} entries with attn_layout={args.layout}")


if __name__ == "__main__":
    main()
