"""workbench.viz on tiny:llama: renders, collapsed view, diffs, provenance, charts, HTML report.

One module-scoped pipeline run feeds every test (the export is the slow part). The run has
``debug_visualize_dir`` set, so the SVGs the flat-render tests parse are the ones the pipeline
itself wrote after each step.
"""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from report_support import unpacked

from workbench import Workbench
from workbench.pipeline.graph.copy import copy_module
from workbench.pipeline.graph.utils import graph_modules, op_name
from workbench.viz import (
    GraphTooLargeError, assign_layers, created_by, diff_graphs, diff_snapshots, memory_frame,
    module_path, plot_memory, plot_pipeline, render_diff, render_graph, render_snapshot,
    source_location, timing_frame, to_svg, write_report, write_snapshot_svg,
)
from workbench.viz.collapse import CollapsedGraph
from workbench.viz.labels import format_value, penwidth
from workbench.viz.style import KIND_STYLE, op_color, op_kind

SVG_NS = "{http://www.w3.org/2000/svg}"
REPO = Path(__file__).resolve().parents[1]
RMSNORM = "match_rmsnorm_pattern"


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    # linear_weight_layout off: on CPU it rewrites every linear of tiny:llama, and these tests follow
    # one export-created linear from the first snapshot to the last; fuse_rmsnorm kept on the canonical
    # op for the same reason (its CPU backend would swap the norm that match_rmsnorm_pattern created).
    bench = Workbench("tiny:llama", debug_visualize_dir=str(tmp_path_factory.mktemp("renders")),
                      overrides={"linear_weight_layout.enabled": False, "fuse_rmsnorm.backend": "torch"})
    bench.run()
    return bench


@pytest.fixture(scope="module")
def renders(wb) -> Path:
    return Path(wb.snapshots[0].config.debug_visualize_dir)


def svg_nodes(svg: str):
    """{title: <g> element} of every graphviz node in an SVG document."""
    root = ET.fromstring(svg)
    return {g.find(f"{SVG_NS}title").text: g for g in root.iter(f"{SVG_NS}g")
            if g.get("class") == "node"}


def svg_texts(g) -> str:
    return "\n".join(t.text or "" for t in g.iter(f"{SVG_NS}text"))


def exported_linear(gm, suffix: str = "self_attn.o_proj"):
    """A linear node that export_to_gm created and no later transform replaced.

    With ``linear_weight_layout`` off (see the ``wb`` fixture) o_proj survives the whole pipeline
    (fuse_gemms replaces q/k/v and gate/up with fused nodes of its own), so its identity is stable
    from the first snapshot to the last.
    """
    return next(n for n in gm.graph.nodes if op_name(n) == "aten.linear.default"
                and created_by(n) == "export_to_gm" and module_path(n).endswith(suffix))


def written_svg(renders: Path, snap) -> str:
    return (renders / f"{snap.index:02d}_{snap.key}.svg").read_text()


def graph(snap):
    (gm,) = graph_modules(snap.module)
    return gm


# ------------------------------------------------------------------------------ flat render
def test_every_snapshot_rendered_as_valid_svg_with_one_box_per_node(wb, renders):
    files = sorted(p.name for p in renders.glob("*.svg"))
    assert files == [f"{s.index:02d}_{s.key}.svg" for s in wb.snapshots]
    for snap in wb.snapshots:
        nodes = svg_nodes((renders / f"{snap.index:02d}_{snap.key}.svg").read_text())
        assert len(nodes) == snap.num_nodes  # one node group per fx node, nothing else
        assert set(nodes) == set(snap.node_names)

    last = wb.snapshots[-1]
    nodes = svg_nodes((renders / f"{last.index:02d}_{last.key}.svg").read_text())
    gm = graph(last)
    linear = next(n for n in gm.graph.nodes if op_name(n) == "aten.linear.default")
    text = svg_texts(nodes[linear.name])
    assert "aten.linear.default" in text
    assert format_value(linear.meta["val"]) in text  # e.g. f32[s44,s70,64]
    assert text.count("[") >= 1 and "f32" in text
    emb = next(n for n in gm.graph.nodes if op_name(n) == "aten.embedding.default")
    assert format_value(emb.meta["val"]) in svg_texts(nodes[emb.name])


def test_edges_carry_shapes_and_width_by_element_count(wb):
    snap = wb.snapshots[-1]
    source = render_snapshot(snap).source
    gm = graph(snap)
    emb = next(n for n in gm.graph.nodes if op_name(n) == "aten.embedding.default")
    user = next(iter(emb.users))
    edge = re.search(rf"^\s*{emb.name} -> {user.name} \[(.*)\]$", source, re.M)
    assert edge and format_value(emb.meta["val"]) in edge.group(1)
    size = next(n for n in gm.graph.nodes if op_name(n) == "aten.sym_size.int")
    size_edge = re.search(rf"^\s*{size.name} -> \w+ \[.*penwidth=([\d.]+)", source, re.M)
    emb_width = float(re.search(r"penwidth=([\d.]+)", edge.group(1)).group(1))
    assert emb_width > float(size_edge.group(1))  # a tensor edge is wider than a scalar edge
    assert float(penwidth(10**6)) > float(penwidth(10**3)) > float(penwidth(1))


def test_node_without_shape_metadata_is_dashed_with_question_mark(wb):
    mod = copy_module(wb.snapshots[-1].module)
    gm = graph_modules(mod)[0]
    victim = next(n for n in gm.graph.nodes if op_name(n) == "aten.linear.default")
    victim.meta = {k: v for k, v in victim.meta.items() if k != "val"}
    nodes = svg_nodes(to_svg(render_graph(mod)))
    g = nodes[victim.name]
    assert "?" in svg_texts(g).splitlines()
    assert any(p.get("stroke-dasharray") for p in g.iter() if p.tag.endswith(("polygon", "path")))
    other = next(n for n in gm.graph.nodes if op_name(n) == "aten.embedding.default")
    assert not any(p.get("stroke-dasharray") for p in nodes[other.name].iter())


def test_op_colours_are_stable_and_canonical_ops_have_their_own(wb, renders):
    assert op_color("aten.add.Tensor") == op_color("aten.add.Scalar") == op_color("aten.add.Tensor")
    assert op_color("aten.add.Tensor") != op_color("aten.mul.Tensor")
    assert op_kind("workbench.torch_rmsnorm.default") == "canonical"
    assert op_kind("workbench.triton_rmsnorm.default") == "backend"
    assert op_kind("workbench.flashinfer_rope.default") == "backend"
    assert op_kind("workbench.torch_cached_attention_with_cache.default") == "cached"
    assert op_kind("aten.linear.default") == "call_function"
    # the same node has the same fill in the first and the last snapshot
    first, last = (svg_nodes(written_svg(renders, s)) for s in (wb.snapshots[0], wb.snapshots[-1]))
    name = exported_linear(graph(wb.snapshots[-1])).name
    fill = lambda g: next(p.get("fill") for p in g.iter() if p.tag.endswith("polygon"))  # noqa: E731
    assert fill(first[name]) == fill(last[name]) == op_color("aten.linear.default")
    canonical = [n.name for n in graph(wb.snapshots[-1]).graph.nodes
                 if op_kind(op_name(n)) == "canonical"]
    if canonical:  # matchers in the default pipeline produced workbench ops: drawn in their colour
        assert {fill(last[n]) for n in canonical} == {KIND_STYLE["canonical"]["fillcolor"]}


# ------------------------------------------------------------------------------ size limit
def test_flat_render_above_limit_raises_with_the_ways_out(wb):
    snap = wb.snapshots[-1]
    with pytest.raises(GraphTooLargeError) as err:
        render_snapshot(snap, max_nodes=50)
    msg = str(err.value)
    assert f"{snap.num_nodes} nodes" in msg and "limit of 50" in msg
    for way in ("collapsed=True", "expand=[", "region=", "hops="):
        assert way in msg
    # the suggested region render works and draws exactly the neighbourhood
    region = render_snapshot(snap, region=["embedding"], hops=1, max_nodes=50)
    nodes = svg_nodes(to_svg(region))
    emb = next(n for n in graph(snap).graph.nodes if n.name == "embedding")
    assert set(nodes) == {emb.name, *(n.name for n in emb.all_input_nodes), *(n.name for n in emb.users)}
    with pytest.raises(KeyError, match="close"):
        render_snapshot(snap, region=["embeding"])
    # the debug_visualize_dir writer never refuses: too large for flat -> collapsed
    path = write_snapshot_svg(snap, Path(wb.snapshots[0].config.debug_visualize_dir) / "small",
                              max_nodes=50)
    assert "layers.0" in svg_nodes(path.read_text())


# ------------------------------------------------------------------------------ collapsed view
def test_collapsed_has_one_box_per_layer_and_expand_opens_one(wb):
    snap = wb.snapshots[-1]
    gm = graph(snap)
    num_layers = wb.loaded.config.num_hidden_layers
    layers = assign_layers(gm)
    assert sorted({v for v in layers.values() if v is not None}) == list(range(num_layers))

    nodes = svg_nodes(to_svg(render_snapshot(snap, collapsed=True)))
    boxes = sorted(t for t in nodes if re.fullmatch(r"layers\.\d+", t))
    assert boxes == [f"layers.{k}" for k in range(num_layers)]
    assert not any(layers[n] is not None and n.name in nodes for n in gm.graph.nodes)
    view = CollapsedGraph(gm, layers, ())
    assert len(nodes) == view.num_boxes < snap.num_nodes

    opened = svg_nodes(to_svg(render_snapshot(snap, expand=[0])))
    layer0 = {n.name for n, k in layers.items() if k == 0}
    assert layer0 <= set(opened) and "layers.0" not in opened
    assert {f"layers.{k}" for k in range(1, num_layers)} <= set(opened)
    assert any("aten.linear.default" in svg_texts(opened[n]) for n in layer0)
    with pytest.raises(ValueError, match="no decoder layer"):
        render_snapshot(snap, expand=[99])


def test_nodes_without_module_stack_inherit_their_layer(wb):
    mod = copy_module(wb.snapshots[-1].module)
    gm = graph_modules(mod)[0]
    before = assign_layers(gm)
    node = next(n for n in gm.graph.nodes if before[n] == 1 and n.op == "call_function"
                and not any(a.op == "get_attr" for a in n.all_input_nodes)
                and all(before[a] == 1 for a in n.all_input_nodes if a.op == "call_function"))
    node.meta.pop("nn_module_stack")
    assert module_path(node) is None
    assert assign_layers(gm)[node] == 1


# ------------------------------------------------------------------------------ provenance
def test_provenance_names_the_creating_transform(wb, renders):
    snap = wb.snapshots[-1]
    gm = graph(snap)
    for node in gm.graph.nodes:
        assert created_by(node) in wb.keys
    linear = exported_linear(gm)
    assert created_by(linear) == "export_to_gm"
    assert module_path(linear) == "model.model.layers.0.self_attn.o_proj"
    assert source_location(linear).endswith("in forward") and ".py:" in source_location(linear)
    nodes = svg_nodes(to_svg(render_snapshot(snap, show_provenance=True)))
    text = svg_texts(nodes[linear.name])
    assert "by export_to_gm" in text and "in layers.0.self_attn.o_proj" in text
    assert "by export_to_gm" not in svg_texts(svg_nodes(written_svg(renders, snap))[linear.name])
    if RMSNORM in wb.keys:
        norm = next(n for n in gm.graph.nodes if "torch_rmsnorm" in op_name(n))
        assert created_by(norm) == RMSNORM and norm.meta.get("wb_replaces")
        diff = diff_snapshots(wb.snapshots[wb.index(RMSNORM) - 1], wb.snapshot(RMSNORM))
        assert set(diff.nodes.loc[diff.nodes["change"] == "replacement", "created_by"]) == {RMSNORM}


# ------------------------------------------------------------------------------ diffs
def test_diff_of_cast_cleanup_lists_exactly_the_removed_casts(wb):
    key = "cleanup_identity_dtype_cast"
    i = wb.index(key)
    before, after = wb.snapshots[i - 1], wb.snapshots[i]
    diff = diff_snapshots(before, after)
    assert set(diff.nodes.columns) >= {"change", "name", "op", "target", "shape", "source_module",
                                       "created_by"}
    removed = diff.names("removed")
    assert removed and sorted(removed) == sorted(after.removed_nodes)
    assert diff.names("added", "replacement", "modified", "replaced") == []
    assert set(diff.nodes["target"]) == {"aten.to.dtype"}
    assert set(diff.nodes["created_by"]) == {"export_to_gm"}
    delta = diff.op_delta.set_index("op")["delta"].to_dict()
    assert delta == {"aten.to.dtype": -len(removed)}
    ghosts = [t for t in svg_nodes(to_svg(render_diff(diff))) if t.endswith("(removed)")]
    assert sorted(ghosts) == sorted(f"{n} (removed)" for n in removed)
    assert diff_snapshots(after, after).empty


def test_diff_of_rmsnorm_lists_exactly_the_norm_sites_as_replaced(wb):
    if RMSNORM not in wb.keys:
        pytest.skip(f"{RMSNORM} is not in the default pipeline")
    i = wb.index(RMSNORM)
    before, after = wb.snapshots[i - 1], wb.snapshots[i]
    diff = diff_snapshots(before, after)
    sites = diff.nodes[diff.nodes["change"] == "replacement"]
    num_layers = wb.loaded.config.num_hidden_layers
    assert len(sites) == 2 * num_layers + 1 == after.info.num_matches  # 2 per layer + final norm
    assert set(sites["target"]) == {"workbench.torch_rmsnorm.default"}
    norm_modules = {p for p in (module_path(n) for n in graph(before).graph.nodes)
                    if p and p.endswith("norm")}
    assert set(sites["source_module"]) == norm_modules
    replaced = diff.nodes[diff.nodes["change"] == "replaced"]
    expected = {name for r in sites["replaces"] for name in r.split(", ")}
    assert set(replaced["name"]) == expected
    assert set(replaced["replaced_by"]) == set(sites["name"])
    assert diff.names("added", "removed", "modified") == []
    delta = diff.op_delta.set_index("op")["delta"].to_dict()
    assert delta["workbench.torch_rmsnorm.default"] == len(sites)
    nodes = svg_nodes(to_svg(render_diff(diff)))
    assert set(sites["name"]) <= set(nodes)
    assert "+ " + sites["name"].iloc[0] in svg_texts(nodes[sites["name"].iloc[0]])


def test_diff_matches_nodes_by_name_and_provenance_not_position(wb):
    snap = wb.snapshots[-1]
    mod = copy_module(snap.module)
    gm = graph_modules(mod)[0]
    node = exported_linear(gm)
    node.meta["wb_created_by"] = "some_later_transform"  # same name, different identity
    diff = diff_graphs(snap.module, mod)
    assert diff.names("removed") == [node.name] and diff.names("added") == [node.name]
    assert diff.op_delta.empty  # op counts are equal; the identity changed
    # reordering nodes without changing them is not a change
    assert diff_graphs(snap.module, copy_module(snap.module)).empty


# ------------------------------------------------------------------------------ charts
def test_time_and_memory_views(wb):
    snaps = wb.snapshots
    t = timing_frame(wb)
    assert list(t["transform"]) == wb.keys and len(t) == len(snaps)
    assert (t[["pre_cleanup_s", "apply_s", "post_cleanup_s"]].sum(axis=1) - t["total_s"]).abs().max() < 1e-9
    assert list(t["nodes"]) == [s.num_nodes for s in snaps]
    m = memory_frame(snaps)
    assert {"tracked_before_MiB", "tracked_after_MiB", "delta_MiB", "unexpected", "warning"} <= set(m.columns)
    assert not m["unexpected"].any()
    fig = plot_pipeline(wb)
    assert len(fig.axes) == 3
    # an unexpected memory change is drawn in red
    from matplotlib.colors import to_hex

    flagged = [dataclasses.replace(s, mem_warning="grew by 1 MiB") if s.index == 2 else s for s in snaps]
    assert memory_frame(flagged)["unexpected"].tolist() == [s.index == 2 for s in snaps]
    ax = plot_memory(flagged).axes[0]
    after_bars = ax.patches[len(snaps):]
    assert to_hex(after_bars[2].get_facecolor()) == "#d32f2f"
    assert to_hex(after_bars[0].get_facecolor()) != "#d32f2f"


# ------------------------------------------------------------------------------ HTML report
class _Sections(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections, self.links, self.body = [], [], {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "step" in (a.get("class") or ""):
            self.sections.append(a["id"])
        if tag == "a" and (a.get("class") in ("prev", "next")):
            self.links.append((a["class"], a["href"]))
        if tag == "body":
            self.body = a


@pytest.fixture(scope="module")
def report(wb, tmp_path_factory) -> Path:
    return write_report(wb, tmp_path_factory.mktemp("report"))


def test_report_is_standalone_with_a_section_per_transform(wb, report):
    html = unpacked(report.read_text())
    parser = _Sections()
    parser.feed(html)
    n = len(wb.snapshots)
    assert parser.sections == [f"step-{i:02d}" for i in range(n)]
    assert parser.links.count(("next", "#step-01")) == 1 and ("prev", f"#step-{n - 2:02d}") in parser.links
    assert len([lk for lk in parser.links if lk[0] == "next"]) == n - 1
    assert html.count('class="dataframe diff-table"') >= 1
    assert "http://" not in html.replace("http://www.w3.org", "")  # no network resources
    assert "https://" not in html
    assert html.count('<div class="graph" id="step-00-graph"><svg') == 1 and "data:image/png;base64," in html
    assert not (report.parent / "svg").exists()  # each render stored once, in the report
    assert html.count("&quot;debug_visualize_dir&quot;") == n  # each config, as escaped JSON


# The report in headless Chromium (graphs rendered, nothing overflowing at 1400 px, a screenshot):
# tests/test_report_browser.py.


# ------------------------------------------------------------------------------ layering rules
def test_pipeline_never_imports_viz_and_viz_never_imports_ipywidgets():
    root = REPO / "workbench"
    for path in (root / "pipeline").rglob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+(\.\.viz|workbench\.viz)", path.read_text(), re.M), path
    for path in (root / "viz").rglob("*.py"):
        assert "ipywidgets" not in path.read_text(), path
