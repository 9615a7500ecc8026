"""``python -m workbench.ops.cpu_kernels``: build the C++ CPU kernels ahead of time (``make install``)."""

from . import build_dir, load

reason = load()
print(f"workbench CPU kernels: {'ready in ' + str(build_dir()) if reason is None else 'unavailable: ' + reason}")
