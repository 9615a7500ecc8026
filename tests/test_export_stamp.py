"""export_to_gm's layer stamping: a model traced with 3 layers and the rest stamped gives the graph of
a full export, node for node, and refuses (with the reason) where layers differ."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.fx as fx

from workbench.api import Workbench
from workbench.models import load_model
from workbench.models.tiny import TINY_ARCHS


def _deeper(name: str, layers: int, **extra):
    def build():
        config = TINY_ARCHS[name]()
        config.num_hidden_layers = layers
        for key, value in extra.items():
            setattr(config, key, value)
        if hasattr(config, "layer_types") and config.layer_types is not None and not extra.get("layer_types"):
            config.layer_types = [config.layer_types[0]] * layers
        return config
    return build


def _export(loaded, stamp: bool):
    wb = Workbench(loaded, overrides={"export_to_gm.stamp_repeated_layers": stamp})
    return wb.step()


def _canonical(graph: fx.Graph) -> List[tuple]:
    """The computation as a list of (op, target, args): a weight read is named by its target, any
    other node by its position among the computing nodes. Equal lists = the same computation on the
    same weights, whatever the node names and wherever export put the get_attr nodes."""
    compute = [n for n in graph.nodes if n.op != "get_attr"]
    index: Dict[fx.Node, int] = {n: i for i, n in enumerate(compute)}

    def norm(a):
        if isinstance(a, fx.Node):
            return ("weight", str(a.target)) if a.op == "get_attr" else ("node", index[a])
        return str(a) if isinstance(a, torch.SymInt) else a

    return [(n.op, str(n.target), repr(fx.node.map_aggregate(n.args, norm)), repr(fx.node.map_aggregate(n.kwargs, norm)))
            for n in compute]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "mistral"])
def test_stamped_export_is_the_full_export_node_for_node(arch):
    loaded = load_model(f"tiny:{arch}", tiny_registry={arch: _deeper(arch, 6)})
    stamped, full = _export(loaded, True), _export(loaded, False)
    assert stamped.info.details["layers"] == "traced 3 of 6 layers; layers 3-5 stamped from layer 2"
    assert full.info.details["layers"] == "full export (stamp_repeated_layers: false)"
    assert _canonical(stamped.graph) == _canonical(full.graph)
    targets = lambda g: sorted(str(n.target) for n in g.nodes if n.op == "get_attr")  # noqa: E731
    assert targets(stamped.graph) == targets(full.graph)
    # the probe ran both against the eager model on the same weights: both exact
    assert stamped.numerics.max_abs == 0.0 and full.numerics.max_abs == 0.0


def test_layers_that_differ_are_exported_in_full_with_the_reason():
    # Qwen2 with a sliding window on layers >= 2 only: layer_types differ between layers
    loaded = load_model("tiny:qwen2", tiny_registry={"qwen2": _deeper("qwen2", 5, use_sliding_window=True,
                                                                       max_window_layers=2, sliding_window=32,
                                                                       layer_types=["full_attention"] * 2
                                                                       + ["sliding_attention"] * 3)})
    snap = _export(loaded, True)
    assert snap.info.details["layers"].startswith("full export: ")
    assert "differ" in snap.info.details["layers"]
    assert snap.numerics.max_abs == 0.0


def test_two_layer_models_are_exported_in_full():
    snap = _export(load_model("tiny:llama"), True)
    assert snap.info.details["layers"] == "full export: 2 layers: nothing to gain over a full trace"
