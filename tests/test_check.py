"""The model registry and `workbench check`: validation errors that name the entry, rows that say why
an entry fails (a transform that stopped the pipeline, attention left uncached, a model that did not
load, an invalid config), the exit code, and both report files.

The runs use tiny:llama three times (a passing entry, one with SDPA matching switched off, one whose
YAML makes insert_cached_attention refuse) plus two entries that fail before any work; one CLI run
over all of them serves every run-based test (~30 s on a 2-core CPU). The oracle: a weak one fails
its row, and every tiny arch gives a strong one (HF's greedy tokens for each check prompt).
"""

import io
import re
import sys
import textwrap

import pytest
import torch

from workbench.cli import main
from workbench.models.spec import BUILTINS, resolve_spec
from workbench.models.tiny import list_tiny_archs
from workbench.onboarding import CheckResult, RegistryError, exit_code, load_registry
from workbench.onboarding.check import CheckSettings, check_entry, check_prompts, compare_tokens, oracle_strength
from workbench.onboarding.registry import RegistryEntry
from workbench.onboarding.report import html_report, markdown_table


def write_registry(folder, text, **files):
    for name, content in files.items():
        (folder / name).write_text(textwrap.dedent(content))
    path = folder / "registry.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------------ registry
def test_validation_names_every_bad_entry_at_once(tmp_path):
    path = write_registry(tmp_path, """
        models:
          - name: tiny:llama
            yaml_extras: [x.yaml]
          - name: tiny:lama
          - name: tiny:qwen2
            yaml_extra: [configs/nope.yaml]
    """)
    with pytest.raises(RegistryError) as e:
        load_registry(path)
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "entry 1 ('tiny:llama'): unknown field 'yaml_extras' (did you mean 'yaml_extra'?)" in msg
    assert "entry 2 ('tiny:lama'): unknown tiny arch 'lama' (did you mean 'tiny:llama'" in msg
    assert re.search(r"known: .*\bmamba2\b.*\bqwen2_5_vl\b", msg)  # the known archs are listed
    assert "entry 3 ('tiny:qwen2'): yaml_extra file 'configs/nope.yaml' not found" in msg
    assert str((tmp_path / "configs" / "nope.yaml").resolve()) in msg  # where it looked


def test_validation_rejects_bad_shapes_and_duplicate_labels(tmp_path):
    with pytest.raises(RegistryError, match="expected one top-level key 'models:'"):
        load_registry(write_registry(tmp_path, "entries: []\n"))
    with pytest.raises(RegistryError, match="field 'slow': Input should be a valid boolean"):
        load_registry(write_registry(tmp_path, "models:\n  - {name: tiny:llama, slow: sometimes}\n"))
    with pytest.raises(RegistryError, match="label 'llama' is used by 2 entries"):
        load_registry(write_registry(tmp_path, "models:\n  - name: tiny:llama\n  - name: tiny:llama\n"))
    with pytest.raises(RegistryError, match="not found"):
        load_registry(tmp_path / "missing.yaml")


def test_yaml_extra_is_relative_to_the_registry_folder_and_selection(tmp_path):
    (tmp_path / "configs").mkdir()
    path = write_registry(tmp_path, """
        models:
          - name: tiny:qwen2_5_vl
            yaml_extra: [configs/mrope.yaml]
          - {name: tiny:llama, label: llama_slow, slow: true}
          - name: tiny:mamba2
    """, **{"configs/mrope.yaml": "transforms: {initialize_mrope_delta_cache: {enabled: true}}\n"})
    reg = load_registry(path)
    assert reg.entries[0].yaml_extra == [str((tmp_path / "configs" / "mrope.yaml").resolve())]
    assert reg.keys == ["qwen2_5_vl", "llama_slow", "mamba2"]
    assert [e.redraw_ssm for e in reg.entries] == [True, True, True]  # weights: auto on tiny: models
    run, skipped = reg.select(quick=True)
    assert [e.key for e in run] == ["qwen2_5_vl", "mamba2"] and [e.key for e in skipped] == ["llama_slow"]
    run, skipped = reg.select(["llama_slow", "tiny:mamba2"], quick=True)  # named entries run even when slow
    assert [e.key for e in run] == ["llama_slow", "mamba2"] and skipped == []
    with pytest.raises(RegistryError, match=r"'mamba' \(did you mean 'mamba2'"):
        reg.select(["mamba"])


def test_every_shipped_entry_names_a_registered_model():
    reg = load_registry()  # validates fields, tiny archs and yaml_extra files
    assert len(reg.entries) >= 30
    for entry in reg.entries:
        if entry.name in BUILTINS:
            continue  # built-in: resolving it checks an optional package is installed, not the registry
        assert resolve_spec(entry.name).kind in ("tiny", "hf_dir", "gguf"), entry.name
    slow = {e.key for e in reg.entries if e.slow}
    assert "smollm2" in slow  # the real checkpoint must stay out of `--quick`


# ------------------------------------------------------------------------------------------ pieces
def test_compare_tokens_names_the_first_difference():
    assert compare_tokens([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == (True, "yes")
    ok, text = compare_tokens([[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 9, 5], [7]])
    assert not ok and text == "no: prompt 2 of 3 differs at new token 1: 4 vs HF 9 (1 of 3 equal)"
    ok, text = compare_tokens([[1]], [[1, 2]])
    assert not ok and "token 1: 1 tokens vs HF 2" in text


def test_report_escapes_cells():
    bad = CheckResult(key="x|y", model="tiny:<b>", stopped_at="load", error="ModelSpecError: <script>&")
    html = html_report([bad])
    assert "<script>" not in html and "&lt;script&gt;&amp;" in html and "tiny:&lt;b&gt;" in html
    assert "0 of 1 entries pass" in html
    assert "| x\\|y | tiny:<b> |" in markdown_table([bad])  # a pipe in a cell does not split the row


def test_a_weak_oracle_fails_its_row():
    """HF's greedy tokens repeating a token or two would also "match" a broken cache: the row fails, its
    oracle cell and result say why in one line each; the threshold is a CheckSettings field."""
    kw = dict(transforms_run=3, transforms_total=3, cache_kinds=["paged KV"], runner_cache="paged KV cache",
              tokens_equal=True, tokens="yes")
    strong = CheckResult(key="s", model="tiny:s", oracle_tokens=12, **kw)
    weak = CheckResult(key="w", model="tiny:w", oracle_tokens=3, **kw)
    assert strong.passed and not strong.weak_oracle
    assert weak.failure == ("weak oracle: HF's greedy tokens for a prompt hold only 3 distinct tokens "
                            "(at least 8 needed to tell a broken cache from a working one)")
    assert exit_code([strong, weak]) == 1
    rows = parse_rows(markdown_table([strong, weak]))
    assert rows["s"]["HF distinct tokens"] == "12" and rows["w"]["HF distinct tokens"] == "3 (weak: < 8)"
    assert rows["w"]["result"].startswith("FAIL: weak oracle: HF's greedy tokens for a prompt hold only 3")
    lenient = CheckResult(key="l", model="tiny:l", oracle_tokens=3, min_oracle_tokens=2, **kw)
    assert lenient.passed
    differs = CheckResult(key="d", model="tiny:d", oracle_tokens=3, **{**kw, "tokens_equal": False})
    assert differs.failure == "tokens differ from HF"  # the worse failure is named first
    assert oracle_strength([[1, 2, 3, 1], [4, 4, 4, 4]]) == 1 and oracle_strength([]) is None


def test_check_entry_counts_the_oracle_and_applies_the_threshold():
    entry = RegistryEntry(name="tiny:llama")
    result = check_entry(entry, CheckSettings(prompt_lens=(5, 7), new_tokens=10, min_oracle_tokens=11))
    assert result.oracle_tokens is not None and 8 <= result.oracle_tokens <= 10 and result.tokens_equal
    assert result.weak_oracle and result.failure.startswith("weak oracle") and result.min_oracle_tokens == 11


def test_exit_code():
    good = CheckResult(key="a", model="tiny:a", transforms_run=3, transforms_total=3, cache_kinds=["paged KV"],
                       runner_cache="paged KV cache", tokens_equal=True, tokens="yes")
    differs = CheckResult(key="b", model="tiny:b", transforms_run=3, transforms_total=3, tokens_equal=False)
    assert good.passed and differs.failure == "tokens differ from HF"
    assert exit_code([good]) == 0 and exit_code([good, differs]) == 1 and exit_code([]) == 0


# ------------------------------------------------------------------------------------------ runs
REGISTRY = """
    models:
      - {name: tiny:llama, label: bad_config, overrides: {export_to_gm.example_seq_len: 0}}
      - {name: ./no/such/model, label: no_model}
      - {name: tiny:llama, label: broken, yaml_extra: [refuse_uncached.yaml]}
      - {name: tiny:llama, label: uncached, overrides: {match_sdpa_to_torch_attention.enabled: false}}
      - {name: tiny:llama, label: ok}
      - {name: tiny:llama, label: slow_one, slow: true}
"""
# SDPA left as is and cached attention required: insert_cached_attention must refuse (a deterministic
# failure in the cache stage, after every earlier transform ran and was probed)
REFUSE_UNCACHED = """
    transforms:
      match_sdpa_to_torch_attention: {enabled: false}
      insert_cached_attention: {require_cached_attention: true}
"""


def parse_rows(markdown: str) -> dict:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in re.split(r"(?<!\\)\|", lines[0])[1:-1]]
    rows = [dict(zip(header, (c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]))) for ln in lines[1:]]
    return {r["entry"]: r for r in rows}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check")
    reg = write_registry(folder, REGISTRY, **{"refuse_uncached.yaml": REFUSE_UNCACHED})
    out = folder / "report"
    capture = pytest.MonkeyPatch()  # capsys is per test; this fixture runs once per module
    buf = io.StringIO()
    capture.setattr(sys, "stdout", buf)
    try:
        code = main(["check", "--registry", str(reg), "--quick", "--out", str(out)])
    finally:
        capture.undo()
    return dict(code=code, stdout=buf.getvalue(), md=(out / "check_report.md").read_text(),
                html=(out / "check_report.html").read_text())


def test_passing_row(checked):
    row = parse_rows(checked["md"])["ok"]
    assert row["model"] == "tiny:llama" and row["family"] == "llama"
    assert re.fullmatch(r"end \((\d+)/\1 transforms\)", row["reached stage"])
    assert row["cached?"] == "paged KV; runner: paged KV cache"
    assert row["tokens equal HF"] == "yes" and row["result"] == "pass"
    assert int(row["HF distinct tokens"]) >= 8  # a strong oracle: tiny:llama's tokens depend on the context
    # fp32 round-off: the graph computes what HF computes, reordered (fused kernels) at most
    assert float(row["worst probe RMSE"].split()[0]) < 1e-5


def test_uncached_row_says_why(checked):
    row = parse_rows(checked["md"])["uncached"]
    assert row["result"] == "FAIL: 2 attention node(s) left uncached"
    assert row["cached?"].startswith("NO: 2 attention node(s) left without a KV cache (SDPA the pattern matcher")
    assert "runner: uncached (full re-forward)" in row["cached?"]
    # re-running the whole sequence every step is slow, not wrong: the tokens still equal HF's
    assert row["tokens equal HF"] == "yes"


def test_failing_transform_row_names_stage_and_transform(checked):
    row = parse_rows(checked["md"])["broken"]
    assert row["result"] == "FAIL: pipeline stopped at cache_init/insert_cached_attention"
    m = re.fullmatch(r"stopped at cache_init/insert_cached_attention \((\d+)/(\d+) transforms\): (.*)", row["reached stage"])
    assert m and int(m[1]) < int(m[2])
    assert m[3].startswith("ValueError: 2 attention node(s) left without a KV cache")
    assert row["worst probe RMSE"] != "-"  # the snapshots before the failure are kept and probed
    assert row["tokens equal HF"] == "-"


def test_rows_of_entries_that_fail_before_any_work(checked):
    rows = parse_rows(checked["md"])
    assert rows["bad_config"]["result"] == "FAIL: invalid pipeline config"
    assert rows["bad_config"]["reached stage"].startswith("config: ConfigError: transform 'export_to_gm'")
    assert rows["no_model"]["result"] == "FAIL: the model did not load"
    assert "cannot resolve model spec './no/such/model'" in rows["no_model"]["reached stage"]


def test_exit_code_summary_and_reports(checked):
    assert checked["code"] == 1  # one failing row is enough
    summary = "1 of 5 entries pass; 1 slow entry skipped (--quick): slow_one"
    for text in (checked["stdout"], checked["md"], checked["html"]):
        assert summary in text
    assert parse_rows(checked["stdout"]).keys() == parse_rows(checked["md"]).keys() == {
        "bad_config", "no_model", "broken", "uncached", "ok"}
    html = checked["html"]
    assert html.count('<tr class="fail">') == 4 and html.count('<tr class="pass">') == 1
    assert "stopped at cache_init/insert_cached_attention" in html


def test_report_has_a_section_per_entry(checked):
    """Below the table: per entry the prompt -> output samples, the results as a tree (memory
    estimate, stages) and the limitations found."""
    md = checked["md"]
    sections = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^### (\S+) .*?(?=^### |\Z)", md)}
    assert sections.keys() == {"bad_config", "no_model", "broken", "uncached", "ok"}
    ok = sections["ok"]
    assert ok.startswith("### ok (tiny:llama): pass")
    assert re.search(r"^- \[[\d, ]+\] \(\d+ ids\) -> \[[\d, .]+\] \(16 ids\) \| ", ok, re.M)  # no tokenizer: ids
    assert re.search(r"^- memory: needs ~[\d.]+ MiB \(.* from the config on the meta device, x2\); ", ok, re.M)
    assert re.search(r"^  - cache_init: ok \(\d+ ran, [1-9]\d* matched", ok, re.M)
    assert "Limitations: none found" in ok
    broken = sections["broken"]
    assert "FAIL: pipeline stopped at cache_init/insert_cached_attention" in broken.splitlines()[0]
    assert "- stopped at cache_init/insert_cached_attention: ValueError: 2 attention node(s)" in broken
    assert "attention node" in sections["uncached"] and "has no KV cache" in sections["uncached"]
    assert checked["html"].count('<details class="fail">') == 4 and checked["html"].count('<details class="pass">') == 1


def test_an_entry_that_cannot_fit_is_refused_before_loading(monkeypatch):
    """The estimate (float32 weights x2, from the config on meta) against the free memory: a row that
    cannot fit stops at "memory" with both figures, before anything is loaded."""
    from workbench.pipeline.transforms.caches import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: (1000, "available RAM (test)"))
    monkeypatch.setattr("workbench.models.load_model", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    row = check_entry(RegistryEntry(name="tiny:llama"))
    assert row.stopped_at == "memory" and row.failure == "does not fit in memory"
    assert re.match(r"does not fit: the check needs ~[\d.]+ MiB on cpu \([\d.]+ MiB of float32 weights x2 .*\), "
                    r"0\.0 MiB available RAM \(test\)", row.error), row.error


def test_cli_config_failure_and_bad_only(tmp_path, capsys):
    reg = write_registry(tmp_path, "models:\n  - {name: tiny:llama, overrides: {export_to_gm.example_seq_len: 0}}\n")
    assert main(["check", "--registry", str(reg)]) == 1
    assert "0 of 1 entries pass" in capsys.readouterr().out
    assert main(["check", "--registry", str(reg), "--only", "nope"]) == 2  # a bad --only is a usage error
    assert "--only names no entry" in capsys.readouterr().err


def test_every_tiny_arch_has_a_registry_entry():
    """A new tiny family is checked by `workbench check` only once it is listed: forgetting it fails here."""
    from workbench.models.tiny import list_tiny_archs
    from workbench.onboarding.registry import load_registry

    listed = {e.name for e in load_registry().entries}
    assert {f"tiny:{a}" for a in list_tiny_archs()} <= listed


@pytest.mark.parametrize("arch", list_tiny_archs())
def test_every_tiny_arch_gives_a_strong_oracle(arch):
    """HF's greedy continuation of each of the check's prompts holds at least 8 distinct tokens (the
    weights as the check draws them: tiny Mamba-2 mixers re-drawn checkpoint-like)."""
    from workbench.models import load_model
    from workbench.models.tiny_families.ssm import checkpoint_like_ssm_weights
    from workbench.onboarding.check import hf_greedy

    settings = CheckSettings()
    loaded = load_model(f"tiny:{arch}", dtype="float32")
    checkpoint_like_ssm_weights(loaded.model, seed=1)
    vocab = loaded.config.get_text_config().vocab_size
    with torch.no_grad():
        want = [hf_greedy(loaded.model, p, settings.new_tokens) for p in check_prompts(vocab, settings.prompt_lens)]
    assert oracle_strength(want) >= settings.min_oracle_tokens, [len(set(w)) for w in want]
