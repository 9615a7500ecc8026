"""The HTML report's Model Explorer files, packed in one ``explorer.zip``, and its links to them.

Beside every graph the report draws, the graph collection ``explorer/NN_key.json`` and its
overlays ``explorer/NN_key.<overlay>.nodedata.json`` go into ``explorer.zip`` (deflated: SmolLM2's
49 files are 26 MB as they are, 1.3 MB packed -- a report is the page plus that, ~3 MB). Model
Explorer opens the files once unpacked (``unzip explorer.zip``, then ``model-explorer
explorer/NN_key.json`` or its File > open; overlays through "Add per-node data"), and ``workbench
explore --at KEY`` serves any snapshot without them. Without the ``explorer`` extra the report is
the same minus these links, and its top says once how to get them.
"""

from __future__ import annotations

import html
import os
import zipfile
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


class ExplorerArchive:
    """``out/explorer.zip`` being written: entries are added as the report draws graphs, and the
    archive is moved into place by ``close`` (a report that fails leaves no half-written zip)."""

    NAME = "explorer.zip"

    def __init__(self, out: Path) -> None:
        self.path = out / self.NAME
        self._partial = out / f".{self.NAME}.partial"
        self._zip: Optional[zipfile.ZipFile] = None
        self.files = 0

    def add(self, name: str, text: str) -> None:
        if self._zip is None:
            self._zip = zipfile.ZipFile(self._partial, "w", zipfile.ZIP_DEFLATED, compresslevel=6)
        self._zip.writestr(f"{SUBDIR}/{name}", text)
        self.files += 1

    def close(self) -> Optional[Path]:
        """Finish the archive; its path, or None when nothing was added."""
        if self._zip is None:
            return None
        self._zip.close()
        self._zip = None
        os.replace(self._partial, self.path)
        return self.path

    def discard(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None
        self._partial.unlink(missing_ok=True)


def archive_note(archive: ExplorerArchive) -> str:
    """One line for the report's top on how to open the packed files ('' when none were written)."""
    if not archive.files:
        return ""
    return (
        f'<p class="note" id="explorer-archive">Model Explorer files of the drawn graphs: '
        f'<a href="{archive.NAME}">{archive.NAME}</a> ({archive.files} files). '
        f"<code>unzip {archive.NAME}</code>, then <code>model-explorer {SUBDIR}/NN_key.json</code>; "
        "or <code>workbench explore --model ... --at KEY</code> serves a snapshot without them.</p>"
    )


def explorer_links(
    snap: Snapshot, prev: Optional[Snapshot], archive: ExplorerArchive, numerics: Mapping[str, Any]
) -> str:
    """Pack ``snap``'s Model Explorer files into ``archive`` and return the line naming them ('' when
    Model Explorer is not installed or the snapshot kept no graph)."""
    if not explorer_available() or snap.module is None:
        return ""
    from .convert import to_model_explorer
    from .serve import explorer_file_texts

    graph = to_model_explorer(
        snap, prev if prev is not None and prev.module is not None else None, numerics_by_key=numerics
    )
    files = explorer_file_texts(graph)
    for name, text in files:
        archive.add(name, text)
    first, overlays = files[0][0], [name for name, _ in files[1:]]
    names = [name[len(first) - len(".json") + 1 : -len(".nodedata.json")] for name in overlays]
    return (
        f'<p class="explorer-links">Model Explorer: <code class="explorer-graph">{SUBDIR}/{html.escape(first)}</code>'
        + (f" (overlays: {', '.join(html.escape(n) for n in names)})" if names else "")
        + f' in <a href="{archive.NAME}">{archive.NAME}</a>'
        + f" &middot; <code>workbench explore --model ... --at {html.escape(snap.key)}</code> serves it</p>"
    )
