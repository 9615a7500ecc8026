"""Canonical ops, ``torch.ops.workbench.*``: importing this package registers every op.

One folder per category (attention, rope, normalization, mlp, moe), each with a README table.
Every op is a ``torch.library.custom_op`` with its fake (meta) implementation right below it and
a plain-PyTorch reference implementation that runs on CPU.
"""

from . import (  # noqa: F401  # noqa: F401  (after state: stateful ops declare their cache entries)
    attention,
    conv,
    cpu_kernels,  # noqa: F401  (declares the C++ kernels' ops; they build on first use)
    delta_rule,
    distributed,  # noqa: F401  (collectives of sharded graphs)
    linear_attention,
    mla,
    mlp,
    moe,
    normalization,
    quant,
    rglru,
    rope,
    selective_scan,
    sharding_hints,  # noqa: F401  (ops carrying tensor-parallel hints)
    ssm,
    state,
)
