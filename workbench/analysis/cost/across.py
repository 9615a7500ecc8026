"""Predicted (and measured) time per decode step and per prefill token after every transform.

``cost_across_pipeline(wb)`` evaluates the cost model on each snapshot's graph -- the same model,
the same phases -- so the change between two rows is what that transform bought (or cost):
``insert_cached_attention`` turns a decode step from a re-run of the whole history into one
token's work, ``fuse_gemms`` cuts launches at unchanged FLOPs, and so on. With ``measure=True``
each distinct graph is also timed on this machine (best of a few eager runs, no profiler).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import pandas as pd

from .devices import DeviceProfile, device_profile, torch_threads
from .measure import step_function, wall_time
from .sizes import DECODE, PREFILL, Phase
from .table import node_costs


def cost_across_pipeline(
    wb: Any,
    device: Union[str, DeviceProfile] = "this-cpu",
    measure: bool = True,
    decode: Phase = DECODE,
    prefill: Phase = PREFILL,
    keys: Optional[Sequence[str]] = None,
    repeats: int = 2,
    threads: Optional[int] = None,
) -> pd.DataFrame:
    """One row per transform run (``keys``: only those): predicted ms per decode step and us per
    prefill token on ``device``, FLOPs and bytes of a decode step, launches, and with ``measure``
    the measured times on this machine (NaN where the graph cannot run here). A transform that did
    not change the graph (same node names) repeats the previous row's numbers without re-timing.
    ``threads``: intra-op threads for this machine's profile and timings (``devices.torch_threads``)."""
    dev = device_profile(device, threads)
    rows = []
    prev_names: Any = None
    prev: dict = {}
    for s in wb.snapshots:
        if keys is not None and s.key not in keys:
            continue
        row = {"#": s.index, "transform": s.key, "stage": s.stage.value, "status": s.status, "nodes": s.num_nodes}
        if s.graph_copy is None:
            rows.append(row)
            continue
        if prev and s.node_names == prev_names:
            rows.append({**prev, **row})
            continue
        gm = s.module
        d = node_costs(gm, decode, dev)
        p = node_costs(gm, prefill, dev)
        row.update(
            decode_GFLOP=d["flops"].sum() / 1e9,
            decode_MB=d["bytes"].sum() / 1e6,
            launches=int(d["launches"].sum()),
            predicted_decode_ms=d["time_s"].sum() * 1e3,
            predicted_prefill_us_per_token=p["time_s"].sum() * 1e6 / prefill.per,
        )
        if measure:
            fd, fp = step_function(wb, s.key, decode), step_function(wb, s.key, prefill)
            with torch_threads(threads):
                row["measured_decode_ms"] = wall_time(fd, repeats) * 1e3 if fd else float("nan")
                row["measured_prefill_us_per_token"] = (
                    wall_time(fp, repeats) * 1e6 / prefill.per if fp else float("nan")
                )
        rows.append(row)
        prev, prev_names = row, s.node_names
    return pd.DataFrame(rows)


__all__ = ["cost_across_pipeline"]
