"""Reports and renders never lose a run: a missing graphviz ``dot``, an unwritable or full output
directory, or an output failing after the pipeline still leave the user the answer.

What each case promises (tiny:llama, numerics off, on the CPU):

* no ``dot`` (a PATH without it, the real CLI in a subprocess): one notice each for ``--report`` and
  ``--debug-visualize-dir`` before the model loads, the report written without pictures (saying so
  inside), renders written as ``.dot`` sources, the answer printed, exit 0;
* an unwritable or full ``--report`` directory: refused in one line before the model loads;
* a report or render failing after the pipeline: the answer, then one ``error:`` line, exit 1; in
  the Python API the pipeline goes on, the failures recorded in ``render_failures``, warned once.
"""

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.cli import main

REPO = Path(__file__).resolve().parent.parent
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
FAST = ["--model", "tiny:llama", "--no-numerics", "--max-new-tokens", "4"]


def _path_without_dot(tmp_path: Path) -> str:
    """A PATH of links to every program on this one but graphviz's ``dot``: the run keeps its
    compilers and tools, only the renderer is gone (as on a GPU machine without graphviz)."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src = os.path.join(d, name)
            if name != "dot" and not (farm / name).exists() and os.access(src, os.X_OK) and os.path.isfile(src):
                (farm / name).symlink_to(src)
    assert shutil.which("dot", path=str(farm)) is None
    return str(farm)


def test_without_dot_the_run_answers_and_writes_report_and_renders(tmp_path):
    report, renders = tmp_path / "report", tmp_path / "renders"
    env = {**os.environ, "PATH": _path_without_dot(tmp_path), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "workbench.cli", "run", *FAST, "--report", str(report),
           "--debug-visualize-dir", str(renders)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    lines = out.splitlines()
    model_line = next(i for i, line in enumerate(lines) if line.startswith("model: "))
    # one notice per output, both before the model loads, each naming the fix
    missing = ": the graphviz 'dot' binary is missing"
    report_notes = [i for i, line in enumerate(lines) if "--report" + missing in line]
    render_notes = [i for i, line in enumerate(lines) if "debug_visualize_dir" + missing in line]
    assert len(report_notes) == 1 and len(render_notes) == 1, out[:3000]
    assert report_notes[0] < model_line and render_notes[0] < model_line
    for i in report_notes + render_notes:
        assert "apt-get install graphviz" in lines[i]
    # the answer
    assert "\ntokens: [" in out and "\ngenerate: " in out
    assert f"report: {report / 'index.html'}" in out
    assert f"renders: {renders} (Graphviz sources: no dot binary)" in out
    # the report: complete but for its pictures, and it says why
    html = (report / "index.html").read_text()
    assert 'id="no-pictures"' in html and "apt-get install graphviz" in html
    assert "<svg" not in html and "export_to_gm" in html and "data:image/png;base64," in html
    assert (report / "dot" / "00_export_to_gm.dot").read_text().startswith("digraph")
    # the renders: Graphviz sources instead of SVGs
    assert not list(renders.glob("*.svg"))
    sources = sorted(p.name for p in renders.glob("*.dot"))
    assert sources[0] == "00_export_to_gm.dot" and len(sources) >= 5


def test_an_unwritable_report_dir_is_refused_before_the_pipeline(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    t0 = time.perf_counter()
    assert main(["run", *FAST, "--report", str(blocker / "report")]) == 2  # refused up front: usage
    assert time.perf_counter() - t0 < 5  # no model load, no pipeline
    out, err = capsys.readouterr()
    assert "model:" not in out and "transform" not in out
    assert err.strip().splitlines() == [
        f"error: --report {str(blocker / 'report')!r} cannot be written (NotADirectoryError: Not a directory); "
        "pick a directory you can write to"]


def test_a_full_report_disk_is_refused_before_the_pipeline(tmp_path, capsys, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    assert main(["run", *FAST, "--report", str(tmp_path / "report")]) == 2  # refused up front: usage
    out, err = capsys.readouterr()
    assert "model:" not in out and "transform" not in out
    assert "--report" in err and "full disk" in err and "free some space" in err and "Traceback" not in err


def test_a_report_failing_after_the_pipeline_prints_the_answer_then_one_line(tmp_path, capsys, monkeypatch):
    import workbench.viz.report

    def full_disk(*args, **kwargs):
        raise ENOSPC

    monkeypatch.setattr(workbench.viz.report, "write_report", full_disk)
    report = tmp_path / "report"
    assert main(["run", *FAST, "--report", str(report)]) == 1
    out, err = capsys.readouterr()
    assert "export_to_gm" in out and "\ntokens: [" in out and "report: " not in out
    assert err.strip().splitlines()[-1] == (
        f"error: --report {str(report)!r} failed (OSError: [Errno 28] No space left on device); "
        "free some space on that disk or pick a directory on another one")
    assert err.count("error:") == 1 and "Traceback" not in err


@pytest.fixture
def renders_fail(tmp_path, monkeypatch):
    """The disk fills up once the pipeline runs: every render written under ``tmp_path/renders`` fails
    (the up-front check's empty probe file and all other writes go through)."""
    renders = tmp_path / "renders"
    write_text = Path.write_text

    def failing(self, *args, **kwargs):
        if renders in self.parents and self.suffix in (".svg", ".dot"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    return renders


def test_failing_renders_do_not_stop_the_pipeline(renders_fail, caplog):
    from workbench import Workbench

    wb = Workbench("tiny:llama", debug_visualize_dir=str(renders_fail), numerics=False)
    wb.run()
    assert wb.done and len(wb.render_failures) == len([s for s in wb.snapshots if s.module is not None])
    first = wb.render_failures[0]
    assert (first.index, first.key) == (0, "export_to_gm") and "No space left on device" in first.error
    warned = [r for r in caplog.records if "render of #" in r.getMessage()]
    assert len(warned) == 1 and "the pipeline goes on" in warned[0].getMessage()


def test_failing_renders_in_the_cli_print_the_answer_then_one_line(renders_fail, capsys):
    assert main(["run", *FAST, "--debug-visualize-dir", str(renders_fail)]) == 1
    out, err = capsys.readouterr()
    assert "\ntokens: [" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: --debug-visualize-dir {str(renders_fail)!r}: ") and "render(s) failed" in last
    assert "No space left on device" in last and "free some space" in last
    assert err.count("error:") == 1 and "Traceback" not in err
