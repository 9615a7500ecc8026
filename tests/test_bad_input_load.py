"""Bad files and weights are named at load, a failed step never takes the finished ones with it, and
the cache directory can be trusted (its problems said in one line, entries sealed with a checksum,
no pickle or shared library read from a directory others can write).

Beside test_bad_input.py (the CLI's and API's refusals of what a user types)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from workbench import Workbench
from workbench.cli import main
from workbench.errors import InputError
from workbench.models import load_model
from workbench.pipeline.interface import TRANSFORMS, TransformError

ONE_THREAD = True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """tiny:llama (vocabulary 512) as save_pretrained writes it, with a 300-token tokenizer."""

    out = tmp_path_factory.mktemp("tiny_llama")
    load_model("tiny:llama", device="cpu").model.save_pretrained(out)
    _tokenizer(300).save_pretrained(out)
    assert (out / "tokenizer.json").is_file()
    return out


def _tokenizer(n: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(saved, out)
    return out


def _load_error(directory: Path) -> str:
    with pytest.raises(InputError) as err:
        load_model(str(directory), device="cpu")
    return str(err.value)


# ------------------------------------------------------------------------------ named at load


def test_a_good_directory_loads_with_its_tokenizer(saved):
    loaded = load_model(str(saved), device="cpu")
    assert len(loaded.tokenizer) == 300


def test_non_finite_weights_are_named_with_the_tensor_and_count(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    out = _copy(saved, tmp_path)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")
    tensors["model.layers.1.self_attn.q_proj.weight"][0, :2] = float("inf")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    msg = _load_error(out)
    assert "weights hold NaN or Inf" in msg
    assert "model.layers.0.mlp.down_proj.weight: 1 of 8,192 values" in msg
    assert "model.layers.1.self_attn.q_proj.weight: 2 of" in msg


def test_a_nan_put_into_a_loaded_model_is_named_before_any_numerics(saved):
    loaded = load_model(str(saved), device="cpu")
    with torch.no_grad():
        loaded.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    bench = Workbench(loaded)
    with pytest.raises(InputError, match=r"eager model's logits .* NaN/Inf .*model\.layers\.0\.mlp\.down_proj\.weight: 1 of"):
        bench.step()
    assert bench.position == 0


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(saved, tmp_path):
    out = _copy(saved, tmp_path)
    _tokenizer(2006).save_pretrained(out)
    msg = _load_error(out)
    assert "the tokenizer has 2,006 tokens but the model's embedding has 512 rows" in msg
    assert "token ids 512..2,005 cannot be embedded" in msg


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "tokenizer_config.json"])
def test_a_json_file_that_does_not_parse_is_named_with_line_and_column(saved, tmp_path, name):
    out = _copy(saved, tmp_path)
    text = (out / name).read_text()
    (out / name).write_text(text.replace('"', "", 1))  # the first key loses its opening quote
    msg = _load_error(out)
    assert f"{out / name} is not valid JSON: Expecting property name enclosed in double quotes at line " in msg
    assert ", column " in msg and "fix or re-download the file" in msg


def test_missing_config_fields_are_named(saved, tmp_path):
    out = _copy(saved, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    for k in ("hidden_size", "vocab_size"):
        del cfg[k]
    (out / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(out)
    assert "config.json does not set hidden_size, vocab_size" in msg and "add them to config.json" in msg



def test_fields_under_the_class_own_names_count(tmp_path):
    # GPT-2's config.json holds n_embd / n_layer (its attribute_map's stored names), never hidden_size
    from transformers import GPT2Config, GPT2LMHeadModel

    from workbench.models.load_checks import missing_config_fields

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "n_embd" in raw and "hidden_size" not in raw
    assert missing_config_fields(raw, config) == []
    del raw["n_layer"]
    assert missing_config_fields(raw, config) == ["num_hidden_layers"]

# ------------------------------------------------------------------------------ nothing finished lost


def _fail_at(monkeypatch, key, exc):
    def boom(self, gm, ctx):
        raise exc

    monkeypatch.setattr(TRANSFORMS.get(key), "_apply", boom)


def test_without_snapshots_a_failure_keeps_the_finished_rows_and_the_run_resumes(tiny_llama, monkeypatch):
    bench = Workbench(tiny_llama, numerics=False, snapshots=False)
    _fail_at(monkeypatch, "fuse_swiglu", RuntimeError("boom"))
    with pytest.raises(TransformError, match="The steps before it are kept") as err:
        bench.run()
    assert "transform=fuse_swiglu" in str(err.value)
    finished = [s.key for s in bench.snapshots]
    n = bench.keys.index("fuse_swiglu")
    assert finished == bench.keys[:n] and bench.status("fuse_swiglu") == "failed"
    monkeypatch.undo()
    bench.run()  # resumes: the finished steps are repeated from the export first (no graph copies)
    assert bench.done and [s.key for s in bench.snapshots][:n] == finished


def test_skip_on_error_without_snapshots_skips_exactly_that_step(tiny_llama, monkeypatch):
    _fail_at(monkeypatch, "fuse_swiglu", RuntimeError("boom"))
    bench = Workbench(tiny_llama, numerics=False, snapshots=False, overrides=["fuse_swiglu.skip_on_error=true"])
    bench.run()
    assert bench.done and bench.snapshot("fuse_swiglu").status == "failed"
    assert [s.status for s in bench.snapshots].count("failed") == 1
    assert bench.snapshot("fuse_swiglu").info.skip_reason == "error: RuntimeError: boom"


def test_the_cli_table_keeps_the_finished_steps_of_a_failed_run(monkeypatch, capsys):
    _fail_at(monkeypatch, "compile_model", RuntimeError("no CUDA graphs here"))
    code = main(["run", "--model", "tiny:llama", "--no-numerics", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and "transform compile_model (stage compile) failed" in err
    for key in ("export_to_gm", "load_weights", "insert_cached_attention"):
        assert key in out, key


def test_skip_on_error_in_the_cli_goes_on_without_the_step(monkeypatch, capsys):
    _fail_at(monkeypatch, "fuse_rope", RuntimeError("no triton here"))
    code = main(["run", "--model", "tiny:llama", "--no-numerics", "--max-new-tokens", "2",
                 "--set", "fuse_rope.skip_on_error=true"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "fuse_rope" in out and "AttributeError" not in err


# ------------------------------------------------------------------------------ the cache directory


@pytest.fixture
def notices(caplog):
    """The cache's one-line notices of this test (each said once per process: the memory is reset)."""
    from workbench import cache_dir

    cache_dir._said.clear()
    caplog.set_level(logging.WARNING, logger="workbench.cache")
    yield lambda: [r.getMessage() for r in caplog.records if r.name == "workbench.cache"]
    cache_dir._said.clear()


@pytest.mark.parametrize("setting", ["file", "blanks", "read-only"])
def test_an_unusable_cache_directory_is_said_once(tmp_path, monkeypatch, notices, setting):
    from workbench.pipeline.probe_cache import ProbeCache

    if setting == "file":
        value = tmp_path / "a_file"
        value.write_text("x")
    elif setting == "blanks":
        value = "   "
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        value = tmp_path / "ro"
        value.mkdir()
        value.chmod(0o500)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(value))
    ProbeCache(), ProbeCache()
    (line,) = notices()
    expected = {"file": "is a file, not a directory", "blanks": "is set to blanks", "read-only": "is not writable"}
    assert expected[setting] in line


def test_a_tampered_probe_entry_is_rejected_with_a_note(tmp_path, monkeypatch, notices):
    from workbench.pipeline.numerics import Numerics
    from workbench.pipeline.probe_cache import ProbeCache

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    cache = ProbeCache()
    cache.put("k1", Numerics(max_abs=0.5, rmse_ratio=0.25, top1_agreement=0.75))
    assert cache.get("k1").rmse_ratio == 0.25 and notices() == []
    entry = tmp_path / "probes" / "k1.json"
    entry.write_bytes(entry.read_bytes().replace(b"0.25", b"0.0"))  # other valid JSON: a better result
    assert cache.get("k1") is None  # not shown as a measurement: the probe runs again
    (line,) = notices()
    assert str(entry) in line and "does not match its checksum" in line


def test_a_group_writable_cache_is_not_read_for_code(tmp_path, monkeypatch, notices):
    from workbench.ops.cpu_kernels import build
    from workbench.pipeline.transforms.export.export_cache import ExportCache

    root = tmp_path / "cache"
    (root / "exports").mkdir(parents=True)
    root.chmod(root.stat().st_mode | stat.S_IWGRP)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(root))
    cache = ExportCache()
    assert cache.files.dir is None and cache.get("k") is None
    (line,) = notices()
    assert "not reading or writing exports entries (each is a graph the model runs)" in line
    assert f"{root} is writable by its group" in line and f"chmod go-w {root}" in line
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", lambda **kw: pytest.fail("built in an untrusted directory"))
    lib = build.Library("wb_trust_test", ("step_program.cpp",), (), (), "trust-test")
    why = build.build_and_load(lib, Path(build.__file__).parent, "test library")
    assert why is not None and "not building or loading the test library" in why and "writable by its group" in why


# ------------------------------------------------------------------------------ the API's errors, signals, the terminal


def test_disabling_the_export_is_refused_at_construction(tiny_llama):
    from workbench.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"export_to_gm is disabled, but every later transform rewrites the graph"):
        Workbench(tiny_llama, overrides=["export_to_gm.enabled=false"])


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature):
    from workbench.runtime.sampling import SamplingParams

    with pytest.raises(InputError, match=rf"temperature must be a finite number >= 0 \(0: greedy\), got {temperature}"):
        SamplingParams(temperature)


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((torch.tensor([1, 2, 3]), torch.arange(3)), "input_ids must be a 2-D integer tensor [batch, seq]"),
        ((torch.randn(1, 3), torch.arange(3)[None]), "input_ids must be a 2-D integer tensor"),
        ((torch.tensor([[1, 2, 9999]]), torch.arange(3)[None]), "ids outside the vocabulary 0..511 (min 1, max 9999)"),
        ((torch.tensor([[1, 2, 3]]), torch.arange(4)[None]), "position_ids (1, 4) must have input_ids' shape (1, 3)"),
    ],
)
def test_forward_names_bad_ids_and_positions(tiny_llama, args, fragment):
    bench = Workbench(tiny_llama, numerics=False)
    bench.run_to("match_rope_pattern")
    with pytest.raises(InputError) as err:
        bench.forward(*args)
    assert fragment in str(err.value)
    assert bench.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None]).shape == (1, 3, 512)


def test_terminal_output_shows_control_and_bidi_characters_escaped():
    from workbench.cli_run import terminal_safe

    assert terminal_safe("red \x1b[31mtext\x1b[0m") == "red \\x1b[31mtext\\x1b[0m"
    assert terminal_safe("abc\u202edef\nnext\tcol") == "abc\\u202edef\nnext\tcol"
    assert terminal_safe("Paris. café") == "Paris. café"


def test_an_escape_sequence_in_the_prompt_is_not_sent_to_the_terminal(saved, capsys):
    # a model with a tokenizer: its prompt and answer are printed as text (tiny: ones print ids)
    code = main(["run", "--model", str(saved), "--no-numerics", "--max-new-tokens", "2", "--prompt",
                 "hi \x1b[31mred\u202e"])
    out, _ = capsys.readouterr()
    assert code == 0 and "\x1b" not in out and "\u202e" not in out
    assert "prompt: " in out and "\\x1b[31mred\\u202e" in out


def test_sigterm_of_a_real_process_ends_it_like_a_ctrl_c(tmp_path):
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "run", "--model", "tiny:llama", "--no-numerics"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("model:"), line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if not ln.startswith(("WARNING", "INFO"))]
    assert proc.returncode == 143, (out, err)
    assert "Traceback" not in err and lines[-1].startswith("terminated (SIGTERM) "), err


def test_an_entry_from_before_sealing_is_recomputed_quietly(tmp_path, monkeypatch, notices):
    from workbench.pipeline.probe_cache import ProbeCache

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "k1.json").write_text('{"max_abs": 0.5, "rmse_ratio": 0.25, "top1_agreement": 0.75}')
    assert ProbeCache().get("k1") is None and notices() == []
