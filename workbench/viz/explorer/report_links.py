"""The HTML report's links to the Model Explorer files of each drawn snapshot.

Beside every graph the report draws, ``explorer/NN_key.json`` (the graph collection) and its
overlays ``explorer/NN_key.<overlay>.nodedata.json`` are written and linked: Model Explorer opens
them (``model-explorer explorer/NN_key.json``, or its File > open; the overlays through "Add
per-node data"). Without the ``explorer`` extra the report is the same minus these links, and its
top says once how to get them.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Optional

from ...pipeline.snapshot import Snapshot
from .require import INSTALL_HINT, explorer_available

SUBDIR = "explorer"


def missing_note() -> str:
    """One line for the report's top when Model Explorer is not installed ('' when it is)."""
    if explorer_available():
        return ""
    return (
        '<p class="note" id="no-explorer">Model Explorer graph files are not written: '
        f"<code>{html.escape(INSTALL_HINT)}</code> adds them beside every graph.</p>"
    )


def explorer_links(snap: Snapshot, prev: Optional[Snapshot], out: Path, numerics: Mapping[str, Any]) -> str:
    """Write ``snap``'s Model Explorer files under ``out/explorer`` and return the links ('' when
    Model Explorer is not installed or the snapshot kept no graph)."""
    if not explorer_available() or snap.module is None:
        return ""
    from .convert import to_model_explorer
    from .serve import write_explorer_files

    graph = to_model_explorer(
        snap, prev if prev is not None and prev.module is not None else None, numerics_by_key=numerics
    )
    [(path, overlays)] = write_explorer_files([graph], out / SUBDIR)
    rel = f"{SUBDIR}/{path.name}"
    parts = [f'<a class="explorer-graph" href="{html.escape(rel)}">{html.escape(path.name)}</a>']
    for o in overlays:
        name = o.name[len(path.stem) + 1 : -len(".nodedata.json")]
        parts.append(f'<a class="explorer-overlay" href="{SUBDIR}/{html.escape(o.name)}">{html.escape(name)}</a>')
    return (
        f'<p class="explorer-links">Model Explorer: {parts[0]}'
        + (f" (overlays: {', '.join(parts[1:])})" if len(parts) > 1 else "")
        + f" &middot; <code>workbench explore --model ... --at {html.escape(snap.key)}</code> serves it</p>"
    )
