"""Canonical ops, ``torch.ops.workbench.*``: importing this package registers every op.

One folder per category (attention, rope, normalization, mlp, moe), each with a README table.
Every op is a ``torch.library.custom_op`` with its fake (meta) implementation right below it and
a plain-PyTorch reference implementation that runs on CPU.
"""

from . import attention, mlp, moe, normalization, quant, rope, state  # noqa: F401
from . import conv, delta_rule, mla, ssm  # noqa: F401  (after state: stateful ops declare their cache entries)
from . import distributed  # noqa: F401  (collectives of sharded graphs)
from . import cpu_kernels  # noqa: F401  (declares the C++ kernels' ops; they build on first use)
