"""Google's Model Explorer for every snapshot: an interactive viewer with pan, zoom, search, a
collapsible layer hierarchy and data painted on nodes -- what a 1,400-node graph needs once the
panel's fixed-size Graphviz picture stops helping.

convert.py   ``to_model_explorer(snapshot, previous=None, overlays=...)``: one snapshot's fx graph as
             Model Explorer graphs (one group per decoder layer and sub-module, per-node attributes)
overlays.py  the node-data overlays: changes against the previous snapshot, numerics drift, and any
             ``{node name: value}`` (the hook the cost model paints through)
serve.py     the graph files on disk and a local Model Explorer server over one or two snapshots

Model Explorer is an optional extra (``pip install 'workbench[explorer]'``, the
``ai-edge-model-explorer`` wheel, which bundles its web app and runs offline); without it every
entry point here says so in one line (``ExplorerMissingError``). The Graphviz renders are unchanged.
"""

from .convert import ExplorerGraph, to_model_explorer
from .overlays import value_overlay
from .require import ExplorerMissingError, explorer_available, require_model_explorer
from .serve import ExplorerServer, serve_snapshots, write_explorer_files

__all__ = [
    "ExplorerGraph",
    "ExplorerMissingError",
    "ExplorerServer",
    "explorer_available",
    "require_model_explorer",
    "serve_snapshots",
    "to_model_explorer",
    "value_overlay",
    "write_explorer_files",
]
