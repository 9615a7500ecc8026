"""Committed notebooks carry no outputs: `make lint` (and so `make test`) fails when one does.

Outputs in git make a 9 KB notebook a megabyte, show one machine's numbers as if they were the
project's, and leave the tree dirty after every run in JupyterLab (autosave). The notebooks run as
tests (nbval), so their outputs are produced fresh wherever they are wanted.

    python tools/clean_notebooks.py            # check the notebooks git tracks; exit 1 naming the dirty ones
    python tools/clean_notebooks.py --strip    # remove outputs and execution counts in place
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_notebooks() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def dirty_cells(nb: dict) -> int:
    """Code cells holding outputs or an execution count."""
    return sum(
        1 for c in nb.get("cells", []) if c.get("cell_type") == "code" and (c.get("outputs") or c.get("execution_count"))
    )


def strip(nb: dict) -> dict:
    for c in nb.get("cells", []):
        if c.get("cell_type") == "code":
            c["outputs"], c["execution_count"] = [], None
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strip", action="store_true", help="remove outputs and execution counts in place")
    p.add_argument("paths", nargs="*", type=Path, help="notebooks (default: every notebook git tracks)")
    args = p.parse_args(argv)
    dirty = []
    for path in args.paths or tracked_notebooks():
        nb = json.loads(path.read_text())
        n = dirty_cells(nb)
        if not n:
            continue
        if args.strip:
            path.write_text(json.dumps(strip(nb), indent=1, ensure_ascii=False) + "\n")
            print(f"stripped {n} cell(s): {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        else:
            dirty.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({n} cell(s))")
    if dirty:
        print(
            "error: notebooks with saved outputs: " + ", ".join(dirty) + "; run `python tools/clean_notebooks.py "
            "--strip` before committing (outputs are made fresh by the nbval tests)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
