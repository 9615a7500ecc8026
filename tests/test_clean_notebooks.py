"""The guard that keeps saved outputs out of git (tools/clean_notebooks.py, run by `make lint`)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("clean_notebooks", ROOT / "tools" / "clean_notebooks.py")
clean = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clean)


def _notebook(path: Path, outputs: bool) -> Path:
    cell = {"cell_type": "code", "metadata": {}, "source": ["print(1)"], "outputs": [], "execution_count": None}
    if outputs:
        cell.update(outputs=[{"output_type": "stream", "name": "stdout", "text": ["1\n"]}], execution_count=3)
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_the_tracked_notebooks_are_clean():
    assert clean.tracked_notebooks() and clean.main([]) == 0


def test_outputs_fail_the_check_by_name_and_strip_removes_them(tmp_path, capsys):
    dirty, tidy = _notebook(tmp_path / "dirty.ipynb", True), _notebook(tmp_path / "tidy.ipynb", False)
    assert clean.main([str(dirty), str(tidy)]) == 1
    err = capsys.readouterr().err
    assert "dirty.ipynb (1 cell(s))" in err and "tidy.ipynb" not in err and "--strip" in err
    assert clean.main(["--strip", str(dirty)]) == 0
    assert clean.main([str(dirty)]) == 0
    cell = json.loads(dirty.read_text())["cells"][0]
    assert cell["outputs"] == [] and cell["execution_count"] is None and cell["source"] == ["print(1)"]
