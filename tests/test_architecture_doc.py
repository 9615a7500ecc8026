"""docs/architecture.md's "how to add" recipes run as written: every ```python block, in order,
in one namespace (a recipe that stops working fails here)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_every_python_block_of_the_architecture_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
