"""Notebook hygiene: committed without outputs, runnable by the venv's kernel, run by `make test`."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(REPO.glob("notebooks/*.ipynb")) + sorted(REPO.glob("cookbooks/*.ipynb"))


def test_the_tutorials_and_the_cookbook_exist():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart", "02_pattern_matching", "03_kv_cache_and_runtime",
            "04_compile_and_cuda_graphs", "05_debugging_a_pipeline", "smollm2"} <= names


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", path
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell["outputs"] and cell["execution_count"] is None, path


def test_make_test_runs_every_notebook_with_nbval():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TEST_PATHS \?= .*\bnotebooks\b.*\bcookbooks\b", makefile, re.M)
    assert "--nbval-lax" in makefile and "$(TEST_PATHS)" in makefile
