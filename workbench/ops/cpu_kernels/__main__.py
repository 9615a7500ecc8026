"""``python -m workbench.ops.cpu_kernels``: build the C++ CPU kernels ahead of time (``make install``).
The build's own log line (directory, seconds) is shown, so a run that rebuilt says so."""

import logging

from . import build_dir, load

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
reason = load()
print(f"workbench CPU kernels: {'ready in ' + str(build_dir()) if reason is None else 'unavailable: ' + reason}")
