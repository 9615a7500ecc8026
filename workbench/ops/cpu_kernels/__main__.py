"""``python -m workbench.ops.cpu_kernels``: build the C++ CPU kernels (this CPU's variant) and the step
program ahead of time (``make install``). The build's own log line (directory, seconds) is shown, so
a run that rebuilt says so."""

import logging

from . import build_dir, describe, isa, load, load_step_program

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
reason = load()
print(f"workbench CPU kernels: {'ready in ' + str(build_dir()) if reason is None else 'unavailable: ' + reason}")
print(f"  CPU: {isa.cpu_model() or 'unknown'}; {describe()}")
step = load_step_program()
print(f"workbench step program: {'ready' if step is None else 'unavailable: ' + step}")
