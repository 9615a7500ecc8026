"""The notebook panel over the step-through API (``Workbench.ui()``); needs ipywidgets.

Nothing in ``workbench`` imports this package: it uses everything else and only reads or drives it.
"""

from .panel import TABS, WorkbenchPanel

__all__ = ["TABS", "WorkbenchPanel"]
