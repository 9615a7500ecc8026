"""Sharded runs on ``torch.distributed``: N rank processes stepping through the pipeline in lockstep.

``Workbench(model, world_size=N)`` returns a ``ShardedWorkbench``; see README.md for how the ranks
run and for ``torchrun``.
"""

from .group import DEFAULT_DIST_TIMEOUT_S, GroupSpec, destroy_group, init_group, torchrun_env
from .launcher import RankError
from .sharded import ShardedWorkbench
from .summaries import ShardedSnapshot

__all__ = [
    "ShardedWorkbench",
    "ShardedSnapshot",
    "RankError",
    "GroupSpec",
    "init_group",
    "destroy_group",
    "torchrun_env",
    "DEFAULT_DIST_TIMEOUT_S",
]
