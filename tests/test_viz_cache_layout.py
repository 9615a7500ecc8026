"""The collapsed render after the cache stage reads top to bottom: each layer's KV-cache inputs are
bundled into its box (listed there, drawn inside it when expanded), not drawn as 60 top-rank nodes
that push every layer box one step to the right."""

from __future__ import annotations

import pytest

from workbench.api import Workbench
from workbench.viz.render import render_snapshot


def _plain_nodes(dot) -> dict:
    """name -> (x, y) of every node in dot's layout (``-Tplain``)."""
    out = {}
    for line in dot.pipe(format="plain").decode().splitlines():
        parts = line.split()
        if parts and parts[0] == "node":
            out[parts[1].strip('"')] = (float(parts[2]), float(parts[3]))
    return out


@pytest.fixture(scope="module")
def cached(smollm2_q4):
    wb = Workbench(smollm2_q4, numerics=False)
    wb.run_to("insert_cached_attention")
    return wb.snapshot("insert_cached_attention")


def test_collapsed_cached_graph_is_one_column_with_cache_inputs_in_their_layers(cached):
    dot = render_snapshot(cached, collapsed=True)
    pos = _plain_nodes(dot)
    boxes = [pos[f"layers.{k}"] for k in range(30)]
    assert len({round(x, 3) for x, _ in boxes}) == 1, boxes  # one column
    assert [y for _, y in boxes] == sorted((y for _, y in boxes), reverse=True)  # top to bottom, in order
    assert not any(name.startswith(("k_cache_", "v_cache_")) for name in pos)  # bundled, not drawn alone
    assert "inputs: k_cache_7, v_cache_7" in dot.source
    # expanded, layer 7 draws its own cache pages inside its cluster
    opened = render_snapshot(cached, collapsed=True, expand=[7]).source
    cluster = opened.split("cluster_layer_7", 1)[1].split("subgraph cluster_layer", 1)[0]
    assert "k_cache_7" in cluster and "v_cache_7" in cluster
