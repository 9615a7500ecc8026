"""Whether Model Explorer (the optional ``explorer`` extra) is installed, and the one-line error
when it is not: the rest of workbench -- the Graphviz renders, the report -- works without it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install 'workbench[explorer]'"


class ExplorerMissingError(ImportError):
    """Model Explorer is not installed; the message says how to install it."""


def explorer_available() -> bool:
    return importlib.util.find_spec("model_explorer") is not None


def require_model_explorer() -> ModuleType:
    """The ``model_explorer`` package, or ``ExplorerMissingError`` naming the install command."""
    try:
        import model_explorer
    except ImportError as e:
        raise ExplorerMissingError(
            f"Model Explorer is not installed ({e}); install the optional extra: {INSTALL_HINT} "
            "(the ai-edge-model-explorer wheel, which bundles its web app and runs offline)"
        ) from e
    return model_explorer
