"""Transform families, one package each; importing this package registers every transform.

A family package holds its transforms and the helpers only it uses; its docstring lists its
modules and keys. Modules are found here, not listed by hand: a new transform is a module in its
family's package (or a new family package) plus its entry in ``default.yaml``. ``workbench
transforms`` prints the registry: every key, its stage, family module and config fields.

Families share code only through the framework (``pipeline/interface.py``, ``pipeline/graph/``,
``pipeline/matcher/``, ``pipeline/weights.py``), never by importing each other
(``tests/test_architecture.py`` checks it).
"""

from ..interface import discover_transforms

discover_transforms(__name__, __path__)
