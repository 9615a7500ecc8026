"""The graph files Model Explorer opens, and a local Model Explorer server over one or two snapshots.

Files: ``<NN_key>.json`` is a graph collection (Model Explorer's JSON adapter opens it: File > open,
or ``model-explorer <file>``) and ``<NN_key>.<overlay>.nodedata.json`` each overlay (loaded in the
side panel's node-data section). The server is Model Explorer's own (``model_explorer.server``,
Flask, the web app bundled in the wheel: no network needed) started with a config that lists these
files, in a daemon thread of this process, so ``Workbench.explore`` returns while it serves; the
CLI's ``workbench explore`` keeps the process alive instead. Two snapshots: both graphs are loaded,
the later one painted with what changed since the earlier one and the earlier one with what went.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ...errors import InputError
from ...pipeline.snapshot import Snapshot
from .convert import ExplorerGraph, to_model_explorer
from .overlays import removed_overlay
from .require import require_model_explorer

DEFAULT_HOST = "127.0.0.1"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "overlay"


def explorer_file_texts(graph: ExplorerGraph) -> List[Tuple[str, str]]:
    """[(file name, JSON text)] of ``graph`` and its overlays, the graph first. The graph file is
    named by its label (``NN_key.json``): the web app aims overlays by that stem."""
    files = [(f"{graph.label}.json", json.dumps(graph.to_json()))]
    for name, data in graph.overlays.items():
        files.append((f"{_slug(graph.label)}.{_slug(name)}.nodedata.json", data.to_json_string(indent=None)))
    return files


def write_explorer_files(graphs: Sequence[ExplorerGraph], out_dir: os.PathLike | str) -> List[Tuple[Path, List[Path]]]:
    """Write each graph and its overlays under ``out_dir``; [(graph file, [overlay files])]."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for g in graphs:
        paths = []
        for name, text in explorer_file_texts(g):
            (path := out / name).write_text(text)
            paths.append(path)
        written.append((paths[0], paths[1:]))
    return written


def pick_snapshots(
    snapshots: Sequence[Snapshot], keys: Sequence[str], at: Optional[str] = None, compare: Optional[str] = None
) -> Tuple[Snapshot, Optional[Snapshot]]:
    """The snapshot at ``at`` (default: the last one run) and the one at ``compare``; an unknown or
    not-yet-run key is an ``InputError`` listing the keys there are snapshots of."""
    if not snapshots:
        raise InputError("no snapshot yet: run the pipeline (or step it) before exploring it")
    by_key = {s.key: s for s in snapshots}

    def get(key: Optional[str], flag: str) -> Optional[Snapshot]:
        if key is None:
            return None
        if key not in by_key:
            why = "is not a transform of this pipeline" if key not in keys else "has not run yet"
            raise InputError(f"{flag} {key!r} {why}; snapshots to explore: {', '.join(by_key)}")
        return by_key[key]

    main = get(at, "--at") or snapshots[-1]
    return main, get(compare, "--compare")


def explorer_graphs(
    snapshots: Sequence[Snapshot],
    snap: Snapshot,
    compare: Optional[Snapshot] = None,
    overlays: Optional[Mapping[str, Mapping[str, float]]] = None,
) -> List[ExplorerGraph]:
    """The converted graphs to show: ``snap`` (changes against the snapshot before it), or with
    ``compare`` both, earlier first, the later one's changes against the earlier one."""

    def probed(upto: Snapshot) -> Dict[str, Any]:
        return {s.key: s.numerics for s in snapshots if s.index <= upto.index and s.numerics is not None}

    if compare is None:
        prev = next((s for s in snapshots if s.index == snap.index - 1 and s.module is not None), None)
        return [to_model_explorer(snap, prev, overlays, numerics_by_key=probed(snap))]
    before, after = sorted((snap, compare), key=lambda s: s.index)
    if before.index == after.index:
        raise InputError(f"--compare {compare.key!r} is the snapshot shown: pick another one to compare with")
    later = to_model_explorer(after, before, overlays if after is snap else None, numerics_by_key=probed(after))
    earlier = to_model_explorer(before, None, overlays if before is snap else None, numerics_by_key=probed(before))
    gone = removed_overlay(before, after, list(earlier.graph_ids))
    if gone is not None:
        earlier.overlays[f"removed by {after.key}"] = gone
    return [earlier, later]


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def url_data(files: Sequence[Tuple[Path, List[Path]]], expand: Sequence[str] = (), select: str = "") -> str:
    """The web app's ``data`` URL parameter: the graph files, their overlays (each aimed at its
    graph by collection label, which is the file's stem), and with two graphs one pane each, side
    by side (what ``ModelExplorerConfig.to_url_param_value`` leaves out: it targets overlays by file
    name, which the web app does not match against a JSON graph's collection label). ``expand``:
    groups to open (namespaces, ``layers.0/self_attn``), in every pane; ``select``: a node to select
    in the last pane (its attributes in the side panel)."""
    opened = [f"{ns}___group___" for ns in expand]  # the web app's id of a group node
    models, node_data, targets, panes = [], [], [], []
    for i, (graph_path, overlay_paths) in enumerate(files):
        models.append({"url": str(Path(graph_path).resolve())})
        for o in overlay_paths:
            node_data.append(str(Path(o).resolve()))
            targets.append(graph_path.stem)
        panes.append(
            {
                "deepestExpandedGroupNodeIds": opened,
                "selectedNodeId": select if i == len(files) - 1 else "",
                "selectedGraphId": graph_path.stem,
                "selectedCollectionLabel": graph_path.stem,
                "widthFraction": 1.0 / len(files),
            }
        )
    data: Dict[str, Any] = {"models": models, "nodeData": node_data, "nodeDataTargets": targets}
    if len(files) == 2 or opened or select:
        data["uiState"] = {"paneStates": panes}
    return urllib.parse.quote(json.dumps(data))


@dataclass
class ExplorerServer:
    """A running Model Explorer server; ``url`` opens the graphs with their overlays."""

    url: str
    host: str
    port: int
    files: List[Tuple[Path, List[Path]]] = field(default_factory=list)
    thread: Optional[threading.Thread] = None

    def embed(self, height: int = 800) -> Any:
        """An IPython ``IFrame`` of the viewer, for a notebook cell's output."""
        from IPython.display import IFrame

        return IFrame(self.url, width="100%", height=height)


def start_server(
    files: Sequence[Tuple[Path, List[Path]]],
    *,
    host: str = DEFAULT_HOST,
    port: Optional[int] = None,
    wait_s: float = 60.0,
    block: bool = False,
    expand: Sequence[str] = (),
    select: str = "",
) -> ExplorerServer:
    """Model Explorer's server over ``files`` (from ``write_explorer_files``): in a daemon thread
    (returns once it answers its health check), or in this thread with ``block`` (never returns)."""
    me = require_model_explorer()
    if port is None:
        port = free_port(host)
    elif _port_in_use(host, port):
        raise InputError(
            f"--port {port}: something already listens on {host}:{port}; pick another port or leave it out"
        )
    # no ModelExplorerConfig: the page reads the files by path (``url_data``), and without one the
    # server's own start-up line is its bare address, not a second, different URL beside ours
    url = f"http://{host}:{port}/?data={url_data(files, expand, select)}"
    server = ExplorerServer(url=url, host=host, port=port, files=list(files))

    def run() -> None:
        me.server.start(host=host, port=port, config=None, no_open_in_browser=True)

    if block:
        print(f"Model Explorer: {url}\nPress Ctrl+C to stop.", flush=True)
        me.server.start(host=host, port=port, config=None, no_open_in_browser=True)
        return server
    server.thread = threading.Thread(target=run, name=f"model-explorer-{port}", daemon=True)
    server.thread.start()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/check_health", timeout=2) as r:
                if r.read() == b"model_explorer_ok":
                    return server
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"Model Explorer's server on {host}:{port} did not answer within {wait_s:.0f}s")


def serve_snapshots(
    snapshots: Sequence[Snapshot],
    keys: Sequence[str],
    at: Optional[str] = None,
    compare: Optional[str] = None,
    *,
    overlays: Optional[Mapping[str, Mapping[str, float]]] = None,
    out_dir: Optional[os.PathLike | str] = None,
    host: str = DEFAULT_HOST,
    port: Optional[int] = None,
    block: bool = False,
    expand: Sequence[str] = (),
    select: str = "",
) -> ExplorerServer:
    """Convert the snapshot at ``at`` (and ``compare``), write the files (``out_dir``, default a
    fresh temporary directory, removed when the process exits) and serve them, with the groups in
    ``expand`` open (namespaces such as ``layers.0/self_attn``) and node ``select`` selected; see
    ``start_server``."""
    require_model_explorer()
    snap, other = pick_snapshots(snapshots, keys, at, compare)
    graphs = explorer_graphs(snapshots, snap, other, overlays)
    if out_dir is None:
        # the server reads these files for as long as this process lives (its thread is a daemon),
        # so they go when the process exits, not when the returned object is dropped
        out_dir = tempfile.mkdtemp(prefix="workbench-explorer-")
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    files = write_explorer_files(graphs, out_dir)
    return start_server(files, host=host, port=port, block=block, expand=expand, select=select)
