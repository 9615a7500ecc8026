"""``workbench run`` tells its story: the transforms that did something as rows, the ones that changed
nothing folded into one line per stage (``--verbose``: every row), a pipeline time that counts the
numerics probes, and a summary block (answer, backends, speed, memory, time) at the end."""

import re

from workbench import Workbench
from workbench.cli import main
from workbench.run_summary import MILESTONES, changed_nothing, format_table

ONE_THREAD = True


def _rows(table: str):
    return [ln.split()[2] for ln in table.splitlines() if re.match(r"^\d+\s", ln)]


def test_no_op_transforms_fold_into_one_line_per_stage(tiny_llama_done):
    wb = tiny_llama_done
    quiet, prev = [], 0
    for s in wb.snapshots:
        if changed_nothing(s, prev):
            quiet.append(s.key)
        prev = s.num_nodes
    table = format_table(wb)
    shown = _rows(table)
    assert quiet and "quantize_fp8_linear_from_config" in quiet and "insert_cached_attention" not in quiet
    assert set(shown) == {s.key for s in wb.snapshots} - set(quiet) and set(MILESTONES) <= set(shown)
    folds = [ln for ln in table.splitlines() if "changed nothing on this model" in ln]
    stages = {s.stage.value for s in wb.snapshots if s.key in quiet}
    assert sorted(ln.split()[0] for ln in folds) == sorted(stages)  # one line per stage
    assert f"({len(quiet)} transforms folded; --verbose lists every row and note)" in table
    assert "quantize_fp8_linear_from_config:" not in table  # the notes of folded rows too
    everything = format_table(wb, verbose=True)
    assert _rows(everything) == [s.key for s in wb.snapshots] and "quantize_fp8_linear_from_config:" in everything


def test_run_prints_wall_time_with_the_probes_and_a_summary(capsys, monkeypatch):
    # a torch.compile earlier in this process (another test on this worker, a notebook's cell before)
    # left Inductor's cumulative counters non-zero: this torch-simple run compiled nothing, no line
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_hit", counters["inductor"]["fxgraph_cache_hit"] + 5)
    assert main(["run", "--model", "tiny:llama", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"pipeline: (\d+) transforms in ([\d.]+)s wall: the transforms ([\d.]+)s, (\d+) numerics probes", out)
    assert m and int(m.group(1)) == len(Workbench("tiny:llama").entries), out
    assert float(m.group(2)) >= float(m.group(3)) and int(m.group(4)) > 0
    summary = out[out.index("summary:") :].splitlines()
    assert [ln.split()[0] for ln in summary[1:]] == ["answer", "ran", "speed", "memory", "time"]
    tokens = re.search(r"^tokens: (\[.*\])$", out, re.M).group(1)
    assert summary[1].split(None, 1)[1] == tokens
    assert "attention cpu" in summary[2] and "compile torch-simple" in summary[2]
    assert re.search(r"first token \d+ ms, decode [\d.]+ tok/s \(4 tokens\)", summary[3])
    assert re.search(r"weights [\d.]+ MiB, KV cache [\d.]+ MiB, peak RSS [\d.]+ (MiB|GiB)", summary[4])
    assert summary[5].startswith("  time      load ") and "numerics probes" in summary[5]


def test_the_report_summary_holds_the_answer_and_its_speed(tmp_path, capsys):
    assert main(["run", "--model", "tiny:llama", "--no-numerics", "--max-new-tokens", "4", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    tokens = re.search(r"^tokens: (\[.*\])$", out, re.M).group(1)
    page = (tmp_path / "index.html").read_text()
    top = page[page.index('<table class="summary"') :][:4000]
    assert f"<th>answer</th><td>{tokens}</td>" in top
    assert re.search(r"<th>speed</th><td>first token \d+ ms, decode [\d.]+ tok/s</td>", top)
    assert out.index("report: ") > out.index("tokens: ")  # written after the answer
