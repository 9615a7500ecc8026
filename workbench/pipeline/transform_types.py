"""What a transform is configured with and what it reports, as plain values.

``Stages`` (ordered), the fields every transform config has (``TransformConfig``), what one
application reports (``TransformInfo``, with the ``nothing_to_do`` and ``rewrite_info`` finishers),
the ``TransformError`` a failing transform raises, its ``PhaseTimes`` and the ``GraphState`` the
framework passes between transforms. Kept apart from the ``Transform`` base class that runs
transforms and the registry (``interface.py``), which re-exports these names: transforms import
everything they need from ``interface``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from pydantic import BaseModel, ConfigDict, Field


class Stages(str, enum.Enum):
    """Enumerated (ordered!) stages of the transformation pipeline."""

    FACTORY = "factory"
    EXPORT = "export"
    POST_EXPORT = "post_export"
    PATTERN_MATCHER = "pattern_matcher"
    SHARDING = "sharding"
    WEIGHT_LOAD = "weight_load"
    POST_LOAD_FUSION = "post_load_fusion"
    CACHE_INIT = "cache_init"
    VISUALIZE = "visualize"
    COMPILE = "compile"

    @property
    def order(self) -> int:
        return list(Stages).index(self)

    def __lt__(self, other: "Stages") -> bool:  # type: ignore[override]
        return self.order < Stages(other).order


class TransformConfig(BaseModel):
    """Fields every transform has (the seeds' common TransformConfig fields)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)

    stage: Stages = Field(description="The stage of the transformation pipeline where this transform should run.")
    run_per_gm: bool = Field(
        default=True, description="Whether to run the transform per graph (sub)module or on whole module."
    )
    enabled: bool = Field(default=True, description="Whether to enable this transform.")
    skip_on_error: bool = Field(default=False, description="Whether to skip the transform if an error occurs.")
    run_graph_cleanup: bool = Field(
        default=True, description="Whether to run graph cleanup/canonicalization after this transform."
    )
    run_shape_prop: bool = Field(default=False, description="Whether to run shape propagation after this transform.")
    requires_clean_graph: bool = Field(
        default=True, description="Whether this transform requires the graph to be clean before it is applied."
    )
    requires_shape_prop: bool = Field(
        default=False, description="Whether this transform requires shape propagation before it is applied."
    )
    debug_visualize_dir: Optional[str] = Field(
        default=None,
        description="Debug visualization directory. None to disable visualization, or a path "
        "string to specify the output directory.",
    )
    expect_mem_change: bool = Field(
        default=False,
        description="Whether this transform is expected to cause changes in memory stats "
        "(CUDA memory on a GPU; parameter, buffer and cache bytes on CPU).",
    )


class TransformInfo(BaseModel):
    """What a transform reports about one application."""

    model_config = ConfigDict(extra="forbid")

    skipped: bool = Field(default=False, description="Whether the transform was skipped.")
    num_matches: int = Field(default=0, description="Number of matches/rewrites made.")
    is_clean: bool = Field(default=False, description="Whether the graph is clean (canonicalized) after the transform.")
    has_valid_shapes: bool = Field(
        default=False, description="Whether node shape metadata is valid after the transform."
    )
    skip_reason: Optional[str] = Field(
        default=None, description="Why the transform was skipped (disabled, error text, ...)."
    )
    details: Dict[str, Any] = Field(
        default_factory=dict, description="Transform-specific facts worth showing to a user."
    )

    def merged(self, other: "TransformInfo") -> "TransformInfo":
        """Combine infos of several graph modules (``run_per_gm``)."""
        return TransformInfo(
            skipped=self.skipped and other.skipped,
            num_matches=self.num_matches + other.num_matches,
            is_clean=self.is_clean and other.is_clean,
            has_valid_shapes=self.has_valid_shapes and other.has_valid_shapes,
            skip_reason=self.skip_reason or other.skip_reason,
            details={**self.details, **other.details},
        )


def nothing_to_do(gm: torch.fx.GraphModule, reason: str) -> Tuple[torch.fx.GraphModule, "TransformInfo"]:
    """0 matches, with the reason shown in the table and the snapshot."""
    return gm, TransformInfo(num_matches=0, skip_reason=reason)


def rewrite_info(gm: torch.fx.GraphModule, n: int, details: Optional[Dict[str, Any]] = None):
    """The ``TransformInfo`` of a graph rewrite that made ``n`` changes (the one finisher every
    rewriting transform uses): the graph is recompiled when it changed (the framework lints a changed
    graph once after the transform, in its clean-up or on its own); it is clean only if unchanged;
    its shapes are valid when every node carries a fake value after a change (replacements get
    theirs as they are made). With no change both flags are False, which the
    framework reads as "the incoming state stands" -- never a claim about stale metadata.
    """
    if n:
        gm.recompile()
    shapes = n > 0 and all("val" in x.meta for x in gm.graph.nodes if x.op in ("call_function", "placeholder"))
    return gm, TransformInfo(num_matches=n, is_clean=n == 0, has_valid_shapes=shapes, details=dict(details or {}))


class TransformError(RuntimeError):
    """A transform raised; names the key, stage and cause so the user knows what to fix."""

    def __init__(self, key: str, stage: Stages, cause: BaseException):
        self.key, self.stage, self.cause = key, stage, cause
        super().__init__(
            f"[stage={stage.value}, transform={key}] failed: {type(cause).__name__}: {cause}\n"
            f"The steps before it are kept. Fix the config (Workbench.configure('{key}', ...)) or "
            f"disable the transform (Workbench.enable('{key}', False)), or set "
            f"skip_on_error=true for it, then run again: it resumes after them (with snapshots "
            f"off, by repeating them from the export)."
        )


@dataclass
class PhaseTimes:
    """Wall time of one transform application, split by phase (seconds)."""

    pre_cleanup: float = 0.0
    apply: float = 0.0
    post_cleanup: float = 0.0

    @property
    def total(self) -> float:
        return self.pre_cleanup + self.apply + self.post_cleanup


@dataclass
class GraphState:
    """What the framework knows about the current graph between transforms."""

    is_clean: bool = False
    has_valid_shapes: bool = False


__all__ = [
    "Stages",
    "TransformConfig",
    "TransformInfo",
    "nothing_to_do",
    "rewrite_info",
    "TransformError",
    "PhaseTimes",
    "GraphState",
]
