"""The export cache: a repeat run reads the exported graph instead of tracing, and gets the same graph.

Each case points ``WORKBENCH_CACHE_DIR`` at its own directory. "The same graph" is checked three
ways: ``describe`` (every node, its kept meta and its fake value, export's guards aside) of the
exported and the read module; the finished pipeline's graph; and greedy tokens.
"""

import pickle

import pytest
import torch

from workbench.api import Workbench
from workbench.cache_dir import sealed, unsealed
from workbench.models import load_model
from workbench.pipeline.probe_cache import graph_structure
from workbench.pipeline.transforms.export import export_cache as ec


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _exported(spec, **kwargs):
    wb = Workbench(spec, numerics=False, **kwargs)
    snap = wb.step()
    assert snap.key == "export_to_gm"
    return wb, snap


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mamba2"])
def test_a_repeat_export_is_read_and_is_the_same_graph(cache_dir, arch):
    loaded = load_model(f"tiny:{arch}", dtype="float32")
    fresh, snap = _exported(loaded, export_cache=True)
    assert "written" in snap.info.details["export_cache"], snap.info.details["export_cache"]
    assert len(list((cache_dir / "exports").glob("*.pkl"))) == 1
    again, snap2 = _exported(loaded, export_cache=True)
    assert snap2.info.details["export_cache"].startswith("read ("), snap2.info.details["export_cache"]
    assert "read from the export cache" in snap2.info.details["summary"]
    assert ec.describe(again.module) == ec.describe(fresh.module)
    # and the rest of the pipeline makes the same graph from it, which generates the same tokens
    fresh.run()
    again.run()
    assert graph_structure(again.module) == graph_structure(fresh.module)
    prompt = [[3, 17, 5, 9, 11]]
    want = fresh.generate(prompt, max_new_tokens=6, stop_token_ids=[]).results[0].token_ids
    assert again.generate(prompt, max_new_tokens=6, stop_token_ids=[]).results[0].token_ids == want


def test_a_run_without_the_cache_neither_reads_nor_writes(cache_dir):
    _, snap = _exported("tiny:llama")
    assert "export_cache" not in snap.info.details
    assert not (cache_dir / "exports").exists()


def test_a_changed_config_or_model_is_a_new_entry(cache_dir):
    loaded = load_model("tiny:llama", dtype="float32")
    _exported(loaded, export_cache=True)
    _, snap = _exported(loaded, export_cache=True, overrides=["export_to_gm.max_seq_len=96"])
    assert snap.info.details["export_cache"].startswith("no entry"), snap.info.details["export_cache"]
    _, snap = _exported(load_model("tiny:llama", dtype="bfloat16"), export_cache=True)
    assert snap.info.details["export_cache"].startswith("no entry"), snap.info.details["export_cache"]
    assert len(list((cache_dir / "exports").glob("*.pkl"))) == 3


def test_an_unreadable_entry_means_exporting_again(cache_dir):
    loaded = load_model("tiny:llama", dtype="float32")
    _exported(loaded, export_cache=True)
    (entry,) = (cache_dir / "exports").glob("*.pkl")
    entry.write_bytes(sealed(entry.stem, b"not a pickle"))
    _, snap = _exported(loaded, export_cache=True)
    assert snap.info.details["export_cache"].startswith("no entry: exported; written")
    # an entry that unpickles but no longer builds (an operator that is gone): exported again, said why
    record = pickle.loads(unsealed(entry.stem, entry.read_bytes()))
    i = next(i for i, n in enumerate(record["nodes"]) if n[2][0] == "op")
    node = list(record["nodes"][i])
    node[2] = ("op", "aten", "no_such_op_xyz", "default")
    record["nodes"][i] = tuple(node)
    entry.write_bytes(sealed(entry.stem, pickle.dumps(record)))
    _, snap = _exported(loaded, export_cache=True)
    note = snap.info.details["export_cache"]
    assert note.startswith("an entry was found but did not build") and "no_such_op_xyz" in note, note


def test_what_the_format_cannot_keep_is_refused_with_the_reason():
    wb, snap = _exported("tiny:llama")
    gm = wb.module
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["source_fn_stack"] = [("fn", lambda x: x)]  # a lambda: cannot be pickled
    with pytest.raises(ec.Uncacheable, match=rf"node {node.name}'s meta 'source_fn_stack' cannot be kept"):
        ec.record_of(gm, snap.info)
    del node.meta["source_fn_stack"]
    node.args = (*node.args, object())
    with pytest.raises(ec.Uncacheable, match=rf"node {node.name} has an argument of type object"):
        ec.record_of(gm, snap.info)


def test_the_cli_reads_the_export_on_a_repeat_run(cache_dir, capsys):
    from workbench.cli import main

    argv = ["run", "--model", "tiny:llama", "--max-new-tokens", "3", "--verbose"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "read from the export cache" in second and "read from the export cache" not in first
    tokens = [line for line in first.splitlines() if line.startswith("tokens:")]
    assert tokens and tokens == [line for line in second.splitlines() if line.startswith("tokens:")]
    assert main([*argv, "--no-export-cache"]) == 0
    assert "read from the export cache" not in capsys.readouterr().out


def test_fake_values_are_rebuilt_symbolic_with_export_ranges(cache_dir):
    loaded = load_model("tiny:llama", dtype="float32")
    fresh, _ = _exported(loaded, export_cache=True)
    again, _ = _exported(loaded, export_cache=True)
    ids = next(n for n in again.module.graph.nodes if n.op == "placeholder").meta["val"]
    assert all(isinstance(s, torch.SymInt) for s in ids.shape)
    env = ids.fake_mode.shape_env
    ranges = [env.var_to_range[s.node.expr] for s in ids.shape]
    fresh_ids = next(n for n in fresh.module.graph.nodes if n.op == "placeholder").meta["val"]
    want = [fresh_ids.fake_mode.shape_env.var_to_range[s.node.expr] for s in fresh_ids.shape]
    assert [(r.lower, r.upper) for r in ranges] == [(r.lower, r.upper) for r in want]


def test_a_record_that_cannot_be_built_never_fails_the_export(cache_dir, monkeypatch):
    def broken(record):
        raise RuntimeError("this torch's shape environment lacks something")

    monkeypatch.setattr(ec, "module_of", broken)
    wb, snap = _exported("tiny:llama", export_cache=True)
    note = snap.info.details["export_cache"]
    assert "not kept: building the record failed (RuntimeError: this torch's" in note, note
    assert not list(cache_dir.glob("exports/*.pkl"))
    assert wb.module is not None and snap.status == "done"
