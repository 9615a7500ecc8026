"""The export cache: a repeat run reads the exported graph instead of tracing, and gets the same graph.

Each case points ``WORKBENCH_CACHE_DIR`` at its own directory. "The same graph" is checked three
ways: ``describe`` (every node, its kept meta and its fake value, export's guards aside) of the
exported and the read module; the finished pipeline's graph; and greedy tokens.
"""

import pytest
import torch

from workbench.api import Workbench
from workbench.cache_dir import sealed, unsealed
from workbench.models import load_model
from workbench.pipeline.probe_cache import graph_structure
from workbench.pipeline.transforms.export import export_cache as ec
from workbench.pipeline.transforms.export import record_json


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
    assert len(list((cache_dir / "exports").glob("*.json"))) == 1
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
    assert len(list((cache_dir / "exports").glob("*.json"))) == 3


def test_an_unreadable_entry_means_exporting_again(cache_dir):
    loaded = load_model("tiny:llama", dtype="float32")
    _exported(loaded, export_cache=True)
    (entry,) = (cache_dir / "exports").glob("*.json")
    entry.write_bytes(sealed(entry.stem, b"not json"))
    _, snap = _exported(loaded, export_cache=True)
    assert snap.info.details["export_cache"].startswith("no entry: exported; written")
    # an entry that decodes but no longer builds (an operator that is gone): exported again, said why
    record = record_json.loads(unsealed(entry.stem, entry.read_bytes()))
    i = next(i for i, n in enumerate(record["nodes"]) if n[2][0] == "op")
    node = list(record["nodes"][i])
    node[2] = ("op", "aten", "no_such_op_xyz", "default")
    record["nodes"][i] = tuple(node)
    entry.write_bytes(sealed(entry.stem, record_json.dumps(record)))
    _, snap = _exported(loaded, export_cache=True)
    note = snap.info.details["export_cache"]
    assert note.startswith("an entry was found but did not build") and "no_such_op_xyz" in note, note


def test_what_the_format_cannot_keep_is_refused_with_the_reason():
    wb, snap = _exported("tiny:llama")
    gm = wb.module
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["source_fn_stack"] = [("fn", lambda x: x)]  # a lambda: no name to find it by
    with pytest.raises(ec.Uncacheable, match="the record holds a value of type function, which the cache format does not hold"):
        ec.checked_record(gm, snap.info)
    node.meta["source_fn_stack"] = [("linear", torch.nn.functional.linear), ("Linear", torch.nn.Linear)]
    assert ec.checked_record(gm, snap.info)  # named functions and classes are kept by name
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


def test_an_entry_cannot_run_code_and_a_crafted_one_is_exported_again(cache_dir, tmp_path):
    """Reading calls nothing the file names: a sympy class fed text (which sympy would parse and
    evaluate), a function outside the fixed tables, a tag the format lacks -- each is refused, the
    model exported again, and the command never runs."""
    loaded = load_model("tiny:llama", dtype="float32")
    _exported(loaded, export_cache=True)
    (entry,) = (cache_dir / "exports").glob("*.json")
    good = unsealed(entry.stem, entry.read_bytes())
    marker = tmp_path / "ran"
    payload = f"__import__('os').system('touch {marker}')"
    crafted = [
        good.replace(b'"shared":[', b'"shared":[{"S":{"o":"sympy.core.add.Add","x":["%s"]}},' % payload.encode()),
        good.replace(b'"shared":[', b'"shared":[{"S":{"o":"sympy.core.sympify.sympify","x":[]}},'),
        good.replace(b'"record":{', b'"record":{"x":{"G":["os","system"]},"y":{"P":"%s"},' % payload.encode()),
        good.replace(b'"format":%d' % record_json.FORMAT, b'"format":%d,"__reduce__":["os.system"]' % record_json.FORMAT),
    ]
    for blob in crafted:
        assert blob != good
        with pytest.raises(Exception):
            record_json.loads(blob)
        entry.write_bytes(sealed(entry.stem, blob))
        _, snap = _exported(loaded, export_cache=True)
        assert snap.info.details["export_cache"].startswith("no entry: exported; written")
    assert not marker.exists()
    assert record_json.loads(good)["format"] == ec.FORMAT


def test_the_record_format_keeps_what_exported_graphs_hold():
    import math

    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing, PythonMod

    from workbench.pipeline.transforms.export.graph_record import _Fake, _Ref, _SymInt

    s0, s1 = (sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
    exprs = [FloorDiv(s0, 2), PythonMod(s0 + 1, 3), sympy.Max(s0, s1), ModularIndexing(s0 * s1, 2, 4),
             s0**2 - 3 * s1, sympy.Rational(1, 2) * s0, sympy.Eq(s0, s1), sympy.oo]
    fake = _Fake((s0, 8), (8, 1), 0, torch.bfloat16, "meta")
    record = {
        "format": ec.FORMAT,
        "exprs": exprs,
        "vals": [fake, fake, _SymInt(s0 * 2), _Ref("add_3")],
        "leaves": (None, True, 3, -2.5, "x" * 100, slice(1, None, 2), Ellipsis, torch.float8_e4m3fn,
                   torch.device("cpu"), torch.strided, torch.channels_last, {"b", "a"}, frozenset({1})),
        "keys": {1: "int key", ("t", 2): [1, [2]], "s": {}},
        "named": [torch.nn.Linear, torch.nn.functional.silu],
        "nonfinite": [float("inf"), float("-inf")],
    }
    back = record_json.loads(record_json.dumps(record))
    assert back == record
    assert [type(e) for e in back["exprs"]] == [type(e) for e in exprs]
    assert back["exprs"][0].free_symbols == {s0} and back["vals"][0] is back["vals"][1]  # shared once
    assert math.isnan(record_json.loads(record_json.dumps({**record, "nan": float("nan")}))["nan"])
    with pytest.raises(ec.Uncacheable, match="holds a value of type object"):
        record_json.dumps({**record, "x": object()})
