"""Test-only transforms for the failure paths of sharded runs (``workbench.parallel``).

Import it through ``worker_imports=["sharding_faults"]`` (tests/ is on sys.path under pytest): the
parent and every rank then register ``raise_on_rank``, which the tests put into a pipeline with
``yaml_extra`` to make exactly one rank fail inside a transform.
"""

from __future__ import annotations

from pydantic import Field

from workbench.pipeline.interface import TransformConfig, TransformInfo, register, Transform


class RaiseOnRankConfig(TransformConfig):
    rank: int = Field(default=1, description="The rank (ctx.dist.rank) that raises; the others pass through.")


@register("raise_on_rank")
class RaiseOnRank(Transform):
    """Raises ``RuntimeError("injected failure on rank N")`` on rank N, does nothing elsewhere.

    A test fixture, never in the default pipeline: it stands for a transform that fails on one rank
    only (an out-of-memory on one device, a shard-shape bug), the case where the other ranks would
    otherwise wait for the failed one inside their next collective.
    """

    config_class = RaiseOnRankConfig

    def _apply(self, gm, ctx):
        if ctx.dist.rank == self.config.rank:
            raise RuntimeError(f"injected failure on rank {ctx.dist.rank}")
        return gm, TransformInfo(num_matches=0, is_clean=True)
