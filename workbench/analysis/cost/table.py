"""Per-node cost frames of a graph and their sums per op category and per decoder layer.

``node_costs(gm, phase, device)`` is one row per ``call_function`` node: op, category, layer,
FLOPs, bytes, launches, roofline time and what bounds it. ``by_category`` / ``by_layer`` sum it;
``category_table`` puts a measured time per category (``measure.py``) beside the prediction.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import pandas as pd
import torch.fx as fx

from .categories import CATEGORIES, op_parts
from .devices import DeviceProfile, device_profile
from .layers import assign_layers
from .rules import node_cost
from .sizes import Phase, SizeBinding, phase_of

COLUMNS = ["node", "op", "category", "layer", "flops", "bytes", "launches", "time_s", "bound", "rule"]


def node_costs(
    gm: fx.GraphModule,
    phase: Union[Phase, str] = "decode",
    device: Union[str, DeviceProfile] = "h100",
    threads: Optional[int] = None,
) -> pd.DataFrame:
    """One row per call node of ``gm`` at ``phase`` on ``device`` (roofline time in seconds;
    ``threads``: of this machine's measured profile)."""
    dev = device_profile(device, threads)
    sizes = SizeBinding(gm, phase_of(phase))
    layers = assign_layers(gm)
    rows = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        c = node_cost(n, sizes, dev.float_bytes)
        ns, name = op_parts(n)
        rows.append(
            {
                "node": n.name,
                "op": f"{ns}::{name}",
                "category": c.category,
                "layer": layers.get(n, ""),
                "flops": c.flops,
                "bytes": c.bytes,
                "launches": c.launches,
                "time_s": dev.node_time(c.flops, c.bytes, c.category, c.launches),
                "bound": dev.bound(c.flops, c.bytes, c.category, c.launches),
                "rule": c.rule,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _sum(frame: pd.DataFrame, by: str) -> pd.DataFrame:
    out = frame.groupby(by, sort=False)[["flops", "bytes", "launches", "time_s"]].sum()
    out["nodes"] = frame.groupby(by, sort=False).size()
    return out


def by_category(frame: pd.DataFrame) -> pd.DataFrame:
    """Sums per op category, in ``CATEGORIES`` order (every category present, zeros included)."""
    return _sum(frame, "category").reindex(list(CATEGORIES), fill_value=0)


def by_layer(frame: pd.DataFrame) -> pd.DataFrame:
    """Sums per decoder layer ("embed", "layer NN", ..., "head")."""
    return _sum(frame, "layer").sort_index(key=lambda ix: ix.map(lambda s: (s != "embed", s == "head", s)))


def category_table(
    frame: pd.DataFrame, phase: Union[Phase, str] = "decode", measured: Optional[Dict[str, float]] = None
) -> pd.DataFrame:
    """Per category: GFLOP, MB moved, launches, predicted ms (per decode step, or per prefill
    token in us) and, with ``measured`` (seconds per step by category, ``measure.py``), the
    measured time in the same unit; a "total" row last (measured total: the wall time per step)."""
    p = phase_of(phase)
    scale, unit = (1e3, "ms") if p.name == "decode" else (1e6 / p.per, "us/token")
    cats = by_category(frame)
    out = pd.DataFrame(
        {
            "GFLOP": cats["flops"] / 1e9,
            "MB": cats["bytes"] / 1e6,
            "launches": cats["launches"].astype(int),
            f"predicted_{unit}": cats["time_s"] * scale,
        }
    )
    if measured is not None:
        out[f"measured_{unit}"] = [measured.get(c, 0.0) * scale for c in out.index]
    total = out.sum(numeric_only=True)
    if measured is not None and "wall" in measured:
        total[f"measured_{unit}"] = measured["wall"] * scale
    out.loc["total"] = total
    out.index.name = "category"
    return out


__all__ = ["node_costs", "by_category", "by_layer", "category_table", "COLUMNS"]
