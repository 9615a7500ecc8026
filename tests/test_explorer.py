"""Model Explorer for every snapshot (``workbench.viz.explorer``) on tiny:llama, without a browser:
the converter's hierarchy (one group per decoder layer, sub-modules inside), per-node attributes, the
overlays (``fuse_gemms``'s changes mark exactly the fused nodes; a ``{node name: value}`` overlay is
painted; a wrong name is refused), two snapshots side by side, the server answering with the graph
files, the report's links, ``Workbench.explore`` and the panel button, and ``workbench explore``
refusing a bad ``--at`` with the list of transforms (exit 2). The real browser:
``test_explorer_browser.py``."""

import json
import sys
import urllib.parse
import urllib.request
import zipfile

import pytest

from workbench import Workbench
from workbench.viz.collapse import assign_layers
from workbench.viz.provenance import created_by, replaces

me = pytest.importorskip("model_explorer", reason="needs the explorer extra (pip install -e '.[explorer]')")

from workbench.viz.explorer import ExplorerMissingError, require_model_explorer, to_model_explorer  # noqa: E402
from workbench.viz.explorer.serve import explorer_graphs, serve_snapshots, url_data, write_explorer_files  # noqa: E402


@pytest.fixture(scope="module")
def wb(tiny_llama):
    wb = Workbench(tiny_llama)
    wb.run_to("fuse_gemms")
    return wb


@pytest.fixture(scope="module")
def fused(wb):
    snap = wb.snapshot("fuse_gemms")
    return to_model_explorer(snap, wb.snapshots[snap.index - 1], numerics_by_key={s.key: s.numerics for s in wb.snapshots})


def test_one_collapsible_group_per_decoder_layer(wb, fused):
    snap = wb.snapshot("fuse_gemms")
    layers = assign_layers(snap.module)
    tops = {ns.split("/")[0] for ns in fused.namespaces()}
    assert {t for t in tops if t.startswith("layers.")} == {"layers.0", "layers.1"}  # tiny:llama: 2 layers
    for node, layer in layers.items():  # every node of layer k inside group layers.k; the rest outside
        ns = fused.node(node.name).namespace
        if layer is None:
            assert not ns.startswith("layers."), (node.name, ns)
        else:
            assert ns.split("/")[0] == f"layers.{layer}", (node.name, ns)
    # sub-modules are groups of their own inside each layer
    for sub in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert any(ns.startswith(f"layers.1/{sub}") for ns in fused.namespaces()), sub
    assert {"embed_tokens", "norm"} <= tops


def test_node_attributes_say_op_shape_transform_and_source(fused):
    node = fused.node("linear_default")  # layer 0's fused Q/K/V GEMM
    attrs = {kv.key: kv.value for kv in node.attrs}
    assert attrs["op"] == "call_function" and attrs["target"] == "aten.linear.default"
    assert attrs["shape"].startswith("f32[") and attrs["shape"].endswith(",128]")  # q+k+v out features
    assert attrs["created_by"] == "fuse_gemms"
    assert attrs["replaces"] == "linear, linear_1, linear_2"
    assert attrs["source_module"].endswith("layers.0.self_attn.q_proj")
    assert ".py:" in attrs["source_line"]
    assert node.label == "linear"
    assert [e.sourceNodeId for e in node.incomingEdges][1].endswith("fused_q_proj_k_proj_v_proj_weight")
    # the graph file round-trips through JSON with the same nodes
    data = json.loads(json.dumps(fused.to_json()))
    assert data["label"] == "39_fuse_gemms" and len(data["graphs"][0]["nodes"]) == len(fused.node_ids())


def test_fuse_gemms_overlay_marks_the_fused_nodes(wb, fused):
    snap = wb.snapshot("fuse_gemms")
    made = {n.name for n in snap.module.graph.nodes if created_by(n) == "fuse_gemms"}
    fused_nodes = {n.name for n in snap.module.graph.nodes if replaces(n) and created_by(n) == "fuse_gemms"}
    assert len(fused_nodes) == 12  # per layer: the concatenated weight, GEMM, split, 3 getitems
    changes = json.loads(fused.overlay_json("changes"))["39_fuse_gemms"]["results"]
    assert set(changes) == made == fused_nodes
    assert {r["value"] for r in changes.values()} == {1}
    # the nodes it removed are listed on the layer groups they were in
    removed = fused.collection.graphs[0].groupNodeAttributes
    assert removed["layers.0"]["removed by fuse_gemms"].endswith("linear, linear_1, linear_2")
    assert list(fused.overlays)[-1] == "changes"  # loaded last: the one the web app shows
    # without a previous snapshot, its own record of what it created says the same
    alone = to_model_explorer(snap)
    assert set(json.loads(alone.overlay_json("changes"))["39_fuse_gemms"]["results"]) == fused_nodes


def test_drift_and_value_overlays(wb, fused):
    drift = json.loads(fused.overlay_json("numerics drift"))["39_fuse_gemms"]
    assert len(drift["results"]) == len(fused.node_ids())  # every node's creator was probed
    assert "gradient" in drift
    snap = wb.snapshot("fuse_gemms")
    cost = {"linear_default": 3.0, "linear_default_1": 1.0}
    g = to_model_explorer(snap, overlays={"cost": cost})
    painted = json.loads(g.overlay_json("cost"))["39_fuse_gemms"]["results"]
    assert {k: v["value"] for k, v in painted.items()} == cost
    with pytest.raises(ValueError, match="not nodes of this graph: nope"):
        to_model_explorer(snap, overlays={"cost": {"nope": 1.0}})


def test_two_snapshots_side_by_side(wb, tmp_path):
    before, after = wb.snapshot("load_weights"), wb.snapshot("fuse_gemms")
    graphs = explorer_graphs(wb.snapshots, after, before)
    assert [g.label for g in graphs] == ["38_load_weights", "39_fuse_gemms"]
    gone = json.loads(graphs[0].overlay_json("removed by fuse_gemms"))["38_load_weights"]["results"]
    assert {"linear", "linear_1", "linear_2"} <= set(gone) and {r["value"] for r in gone.values()} == {-1}
    files = write_explorer_files(graphs, tmp_path)
    data = json.loads(urllib.parse.unquote(url_data(files)))
    panes = data["uiState"]["paneStates"]
    assert [p["selectedCollectionLabel"] for p in panes] == ["38_load_weights", "39_fuse_gemms"]
    assert [p["widthFraction"] for p in panes] == [0.5, 0.5]
    assert data["nodeDataTargets"] == ["38_load_weights"] * 2 + ["39_fuse_gemms"] * 2  # drift, removed; drift, changes


def test_server_serves_the_graph_files(wb, tmp_path):
    server = serve_snapshots(wb.snapshots, wb.keys, "fuse_gemms", out_dir=tmp_path, expand=["layers.0"])
    base = f"http://{server.host}:{server.port}"
    assert urllib.request.urlopen(f"{base}/check_health", timeout=5).read() == b"model_explorer_ok"
    graph_file = str(tmp_path / "39_fuse_gemms.json")
    got = json.loads(urllib.request.urlopen(f"{base}/api/v1/read_text_file?path={graph_file}", timeout=5).read())
    assert json.loads(got["content"])["label"] == "39_fuse_gemms"
    assert "layers.0___group___" in urllib.parse.unquote(server.url)
    assert "Model Explorer" in urllib.request.urlopen(server.url, timeout=5).read().decode()


def test_default_files_are_removed_when_the_process_exits(wb, monkeypatch):
    import workbench.viz.explorer.serve as serve

    at_exit = []
    monkeypatch.setattr(serve.atexit, "register", lambda fn, *args, **kw: at_exit.append((fn, args, kw)))
    server = serve_snapshots(wb.snapshots, wb.keys, "fuse_gemms")
    graph_file = server.files[0][0]
    assert graph_file.exists() and graph_file.parent.name.startswith("workbench-explorer-")
    assert len(at_exit) == 1
    fn, args, kw = at_exit[0]
    fn(*args, **kw)
    assert not graph_file.parent.exists()


def test_workbench_explore_returns_the_url_outside_a_notebook(wb):
    url = wb.explore("fuse_gemms", compare="load_weights")
    assert url.startswith("http://127.0.0.1:") and "39_fuse_gemms" in urllib.parse.unquote(url)
    with pytest.raises(ValueError, match="has not run yet; snapshots to explore: export_to_gm"):
        wb.explore("compile_model")


def test_panel_button_opens_the_selected_snapshot(wb):
    pytest.importorskip("ipywidgets", reason="the panel needs ipywidgets")
    from workbench.widgets import WorkbenchPanel

    panel = WorkbenchPanel(wb)
    panel.select("fuse_gemms")
    url = panel.explore_selected()
    assert url and f"src='{url}'" in panel.explorer.value
    panel.select("compile_model")
    assert panel.explore_selected() is None and "has not run yet" in panel.message.value


def test_report_links_the_model_explorer_files(wb, tiny_llama, tmp_path):
    from workbench.viz.report import write_report

    small = Workbench(tiny_llama, entries=[e for e in wb.entries if e.key in ("export_to_gm", "load_weights", "fuse_gemms")])
    small.run()
    index = write_report(small, tmp_path).read_text()
    assert not (tmp_path / "explorer").exists()  # packed: one deflated archive, not a file per graph
    with zipfile.ZipFile(tmp_path / "explorer.zip") as z:
        names = set(z.namelist())
        graph = json.loads(z.read("explorer/02_fuse_gemms.json"))
        overlay = json.loads(z.read("explorer/02_fuse_gemms.changes.nodedata.json"))
    assert "explorer/00_export_to_gm.json" in names and graph and overlay
    assert 'id="explorer-archive"' in index and 'href="explorer.zip"' in index
    assert 'id="no-explorer"' not in index
    assert not list(tmp_path.glob(".*.partial"))


def test_a_report_that_fails_leaves_no_half_written_archive(wb, tiny_llama, tmp_path, monkeypatch):
    from workbench.viz import report

    small = Workbench(tiny_llama, entries=[e for e in wb.entries if e.key in ("export_to_gm", "load_weights", "fuse_gemms")])
    small.run()
    calls = []

    def fail_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    real = report.explorer_links
    monkeypatch.setattr(report, "explorer_links", fail_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        report.write_report(small, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".", "explorer"))) == []


def test_cli_refuses_a_bad_at_with_the_list_of_transforms(capsys):
    from workbench.cli import main

    assert main(["explore", "--model", "tiny:llama", "--at", "fuse_gemz"]) == 2
    err = capsys.readouterr().err
    assert "--at 'fuse_gemz' is not a transform of this pipeline (did you mean 'fuse_gemms'?)" in err
    assert "its transforms: export_to_gm, " in err and "fuse_gemms" in err


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "model_explorer", None)  # import model_explorer -> ImportError
    with pytest.raises(ExplorerMissingError, match=r"pip install 'workbench\[explorer\]'"):
        require_model_explorer()
