"""The CLI: `workbench run` prints the table, `workbench transforms` lists, bad input is one clear line."""

from workbench.cli import main


def test_run_prints_table(capsys):
    assert main(["run", "--model", "tiny:llama", "--set", "cleanup_noop_add.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert "transform" in out and "numerics" in out
    for key in ["export_to_gm", "cleanup_noop_slice", "cleanup_input_constraints", "cleanup_identity_dtype_cast"]:
        assert key in out
    assert "skipped" in out  # the disabled one
    assert "rmse 0.0e+00" in out

def test_transforms_lists_keys_stages_and_fields(capsys):
    assert main(["transforms"]) == 0
    out = capsys.readouterr().out
    assert "export_to_gm" in out and "export" in out and "example_seq_len" in out

def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`workbench transforms | head`: the output's reader closes the pipe; exit 141 as a shell tool
    would, with no 'error:' line (it was one, as an unexpected BrokenPipeError)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "transforms"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has imported torch, so before it writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_a_broken_pipe_elsewhere_is_still_an_error(capsys, monkeypatch):
    import workbench.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.COMMANDS, "transforms", broken)
    assert main(["transforms"]) == 1  # stdout is fine: some other pipe broke
    assert "error: unexpected BrokenPipeError" in capsys.readouterr().err

def test_bad_override_is_a_clear_error(capsys):
    assert main(["run", "--model", "tiny:llama", "--set", "export_to_gm.strct=true"]) == 2
    err = capsys.readouterr().err
    assert "unknown field 'strct'" in err and "did you mean 'strict'" in err

def test_unknown_model_is_a_clear_error(capsys):
    assert main(["run", "--model", "no/such-model-xyz"]) == 2  # bad input: a usage error
    err = capsys.readouterr().err
    assert "no/such-model-xyz" in err

def test_bad_yaml_path(capsys, tmp_path):
    assert main(["run", "--model", "tiny:llama", "--yaml-extra", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err

def test_run_writes_report_and_renders(capsys, tmp_path):
    report, renders = tmp_path / "report", tmp_path / "renders"
    argv = ["run", "--model", "tiny:llama", "--report", str(report), "--debug-visualize-dir", str(renders),
            "--set", "export_to_gm.max_seq_len=64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"report: {report / 'index.html'}" in out
    html = (report / "index.html").read_text()
    assert "export_to_gm" in html and "cleanup_identity_dtype_cast" in html
    svgs = sorted(p.name for p in renders.glob("*.svg"))
    assert svgs[0] == "00_export_to_gm.svg" and len(svgs) >= 5
