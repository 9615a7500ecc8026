"""The transform framework: the Transform base class, its registry and the pipeline order check.

A transform is a small class registered under its seed key. It declares a pydantic config class
(unknown fields rejected) and implements only ``_apply``. The base class's ``__call__`` owns the
rest -- enable/skip, ``skip_on_error``, graph cleanup and shape propagation before and after as the
flags say, the per-phase timing and the ``[stage=..., transform=...]`` log prefix -- so every
transform gets the same bookkeeping and the step-through driver can rely on it.

The values a transform is configured with and reports (``Stages``, ``TransformConfig``,
``TransformInfo``, ``TransformError``...) are defined in ``transform_types.py`` and re-exported
here, so a transform imports everything it needs from this module.
"""

from __future__ import annotations

import logging
import time
import typing
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    Type,
    cast,
)

import torch
from typing_extensions import TypeVar

from . import transform_types
from .graph.utils import canonicalize_graph, graph_modules, run_shape_prop
from .transform_types import (  # noqa: F401  (all re-exported: see __all__)
    GraphState,
    PhaseTimes,
    Stages,
    TransformConfig,
    TransformError,
    TransformInfo,
    nothing_to_do,
    rewrite_info,
)

if TYPE_CHECKING:
    from .context import Fact, PipelineContext

logger = logging.getLogger("workbench.pipeline")


ConfigT = TypeVar("ConfigT", bound=TransformConfig, default=TransformConfig)


def _config_of(cls: type) -> Optional[Type[TransformConfig]]:
    """The config class a transform class names as its generic parameter (``Transform[XConfig]``,
    or a generic base's ``Base[XConfig]``; a type variable stands for its bound), if any."""
    for base in getattr(cls, "__orig_bases__", ()):
        origin, args = typing.get_origin(base), typing.get_args(base)
        if not (isinstance(origin, type) and issubclass(origin, Transform) and args):
            continue
        arg = args[0]
        if isinstance(arg, typing.TypeVar):
            arg = arg.__bound__
        if isinstance(arg, type) and issubclass(arg, TransformConfig):
            return arg
    return None


class Transform(Generic[ConfigT]):
    """Base class of every transform.

    Subclasses set ``key`` (via the registry decorator), name their config class when they have
    extra fields (``class X(Transform[XConfig])``: it becomes ``config_class`` and the type of
    ``self.config``; a class may also set ``config_class`` itself), and implement
    ``_apply(gm, ctx) -> (gm, TransformInfo)``. ``__call__`` is final.
    """

    key: ClassVar[str] = ""
    config_class: ClassVar[Type[TransformConfig]] = TransformConfig
    config: ConfigT
    # Facts of the context this transform leaves for later ones, and facts it needs from earlier
    # ones (``Fact`` objects, e.g. ``context.CACHE_SPECS``): the stepper refuses a pipeline that
    # orders a need before every transform that could provide it (``check_order``); ``__call__``
    # refuses to run a transform whose required need is absent, and checks that a transform that
    # changed something left what it provides.
    provides: ClassVar[Tuple["Fact", ...]] = ()
    needs: ClassVar[Tuple["Fact", ...]] = ()
    # A rewrite meant to change the logits (quantizing weights or activations). The stepper holds
    # every other transform of the post_export and pattern_matcher stages to the eager model's
    # answer (``pipeline.numerics.MatcherGuard``): one that moves the probe's logits fails its step.
    changes_numerics: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_class" not in cls.__dict__:
            named = _config_of(cls)
            if named is not None:
                cls.config_class = named

    def __init__(self, config: TransformConfig):
        if not isinstance(config, self.config_class):
            config = self.config_class.model_validate(config.model_dump())
        self.config = cast(ConfigT, config)

    @property
    def log_prefix(self) -> str:
        return f"[stage={self.config.stage.value}, transform={self.key}]"

    def _apply(self, gm: torch.nn.Module, ctx: "PipelineContext") -> Tuple[torch.nn.Module, TransformInfo]:
        raise NotImplementedError

    def __call__(
        self, mod: torch.nn.Module, ctx: Optional["PipelineContext"], state: GraphState
    ) -> Tuple[torch.nn.Module, TransformInfo, PhaseTimes]:
        """Apply the transform with the framework's bookkeeping.

        ``state`` describes the incoming graph; it is updated in place with the outgoing state.
        Raises ``TransformError`` unless ``skip_on_error`` is set.
        """
        cfg, times = self.config, PhaseTimes()
        if ctx is None:  # one transform on a graph of the caller's own: a context without a model
            from .context import PipelineContext

            ctx = PipelineContext.standalone()
        if not cfg.enabled:
            info = TransformInfo(
                skipped=True, skip_reason="disabled", is_clean=state.is_clean, has_valid_shapes=state.has_valid_shapes
            )
            return mod, info, times

        t0 = time.perf_counter()
        try:
            for fact in self.needs:
                if fact.required and not fact.present(ctx):
                    from .context import PipelineOrderError

                    raise PipelineOrderError(
                        f"{self.key} needs the {fact}, and no earlier transform left it: "
                        "run the transform that provides it first"
                    )
            targets = graph_modules(mod)
            if cfg.stage.order >= Stages.POST_LOAD_FUSION.order:
                _require_loaded_weights(self.key, cfg.stage, targets)
            if targets and cfg.requires_clean_graph and not state.is_clean:
                for gm in targets:
                    canonicalize_graph(gm)
                state.is_clean = True
            if targets and cfg.requires_shape_prop and not state.has_valid_shapes:
                for gm in targets:
                    run_shape_prop(gm)
                state.has_valid_shapes = True
            t1 = time.perf_counter()
            times.pre_cleanup = t1 - t0

            if targets and cfg.run_per_gm:  # once per graph (sub)module, infos merged
                merged: Optional[TransformInfo] = None
                for gm in targets:
                    out, gm_info = self._apply(gm, ctx)
                    if out is not gm:
                        mod = self._swap(mod, gm, out)
                    merged = gm_info if merged is None else merged.merged(gm_info)
                assert merged is not None  # targets is not empty
                info = merged
            else:
                mod, info = self._apply(mod, ctx)
            missing = [f.name for f in self.provides if info.num_matches and not info.skipped and not f.present(ctx)]
            if missing:
                raise RuntimeError(
                    f"{self.key} changed the graph ({info.num_matches} matches) but left no "
                    f"{', '.join(missing)} in the context, which it provides"
                )
            t2 = time.perf_counter()
            times.apply = t2 - t1
        except Exception as e:  # noqa: BLE001 - recorded, re-raised or skipped on purpose
            if not cfg.skip_on_error:
                raise TransformError(self.key, cfg.stage, e) from e
            logger.warning("%s skipped on error: %s: %s", self.log_prefix, type(e).__name__, e)
            info = TransformInfo(
                skipped=True, skip_reason=f"error: {type(e).__name__}: {e}", is_clean=False, has_valid_shapes=False
            )
            state.is_clean = state.has_valid_shapes = False
            times.apply = time.perf_counter() - t0
            return mod, info, times

        # A transform with no matches left the graph as it was, so the incoming state still holds;
        # otherwise only what the transform itself vouches for.
        unchanged = info.num_matches == 0
        is_clean = info.is_clean or (unchanged and state.is_clean)
        has_shapes = info.has_valid_shapes or (unchanged and state.has_valid_shapes)
        t3 = time.perf_counter()
        graphs = graph_modules(mod)
        if graphs and cfg.run_graph_cleanup and not is_clean:
            for gm in graphs:
                canonicalize_graph(gm)  # lints too
            is_clean = True
        elif graphs and not unchanged:
            for gm in graphs:
                gm.graph.lint()  # a changed graph is always linted, once (rewrite_info leaves it to here)
        if graphs and cfg.run_shape_prop and not has_shapes:
            for gm in graphs:
                run_shape_prop(gm)
            has_shapes = True
        times.post_cleanup = time.perf_counter() - t3
        info = info.model_copy(update={"is_clean": is_clean, "has_valid_shapes": has_shapes})
        state.is_clean, state.has_valid_shapes = is_clean, has_shapes
        logger.info("%s matches=%d time=%.3fs", self.log_prefix, info.num_matches, times.total)
        return mod, info, times

    @staticmethod
    def _swap(root: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> torch.nn.Module:
        """Replace sub-module ``old`` of ``root`` by ``new`` (or return ``new`` if it is the root)."""
        if root is old:
            return new
        for name, sub in root.named_modules():
            if sub is old:
                parent_name, _, attr = name.rpartition(".")
                setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)
                return root
        raise RuntimeError("transform returned a new graph module that could not be re-attached")


def check_order(entries: List[Any], registry: "TransformRegistry") -> Optional[str]:
    """Why this ordered pipeline (``PipelineEntry`` list) runs a transform before what it needs
    (None when it does not). A need with no enabled provider at all is not an order problem: the
    transform then reports itself skipped with the reason, as it always has."""
    enabled = [(i, e.key) for i, e in enumerate(entries) if e.config.enabled]
    exporters = [e for e in entries if e.config.stage == Stages.EXPORT]
    if exporters and not any(e.config.enabled for e in exporters) and enabled:
        names = ", ".join(e.key for e in exporters)
        return (
            f"{names} is disabled, but every later transform rewrites the graph it exports: enable it "
            f"(--set {exporters[0].key}.enabled=true), or disable the whole pipeline to run the eager model"
        )
    for i, key in enabled:
        for fact in registry.get(key).needs:
            providers = [(j, k) for j, k in enabled if any(fact is p for p in registry.get(k).provides)]
            if providers and all(j > i for j, _ in providers):
                names = " or ".join(k for _, k in providers)
                return (
                    f"{key} needs the {fact} that {names} provides, but it runs before "
                    f"{'it' if len(providers) == 1 else 'them'} in this pipeline: run {names} "
                    f"before {key} (its stage, or its place in the YAML)"
                )
    return None


def _require_loaded_weights(key: str, stage: Stages, graphs: List[torch.fx.GraphModule]) -> None:
    """Transforms from post_load_fusion on read or rewrite real weights; a graph still holding the
    meta tensors export traced would give them nothing (fused copies of meta tensors, say)."""
    from .weights import unloaded_targets

    for gm in graphs:
        missing = unloaded_targets(gm)
        if missing:
            raise RuntimeError(
                f"{key} (stage {stage.value}) needs the model's weights, but the graph still holds "
                f"{len(missing)} meta tensors (e.g. {missing[0]}): enable load_weights (stage weight_load) "
                "so that it runs before this transform"
            )


_TransformClass = TypeVar("_TransformClass", bound=Type[Transform[Any]])


@dataclass
class TransformRegistry:
    """Transform classes by seed key.

    Filled by the ``register`` decorator when the transform modules are imported (import time, not
    run time), so the set of known transforms never depends on what ran before.
    """

    _classes: Dict[str, Type[Transform[Any]]] = field(default_factory=dict)

    def register(self, key: str) -> Callable[[_TransformClass], _TransformClass]:
        def deco(cls: _TransformClass) -> _TransformClass:
            if key in self._classes and self._classes[key] is not cls:
                raise ValueError(f"transform key '{key}' registered twice")
            if cls.key and cls.key != key:
                raise ValueError(f"{cls.__name__} is already registered as '{cls.key}'")
            cls.key = key
            self._classes[key] = cls
            return cls

        return deco

    def get(self, key: str) -> Type[Transform[Any]]:
        if key not in self._classes:
            import difflib

            close = difflib.get_close_matches(key, self._classes, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise KeyError(f"unknown transform '{key}'.{hint} Run `workbench transforms` to list them.")
        return self._classes[key]

    def __contains__(self, key: str) -> bool:
        return key in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._classes))

    def items(self):
        return sorted(self._classes.items())

    def copy(self) -> "TransformRegistry":
        """An independent registry with the same transforms (to add experimental ones to)."""
        return TransformRegistry(dict(self._classes))


TRANSFORMS = TransformRegistry()
register = TRANSFORMS.register


def discover_transforms(package: str, path: Iterable[str]) -> List[str]:
    """Import every module below ``package`` (its ``__path__``): each registers its transforms with
    ``register`` as it is defined. Returns the modules imported, in name order."""
    import importlib
    import pkgutil

    names = sorted(m.name for m in pkgutil.walk_packages(list(path), package + "."))
    for name in names:
        importlib.import_module(name)
    return names


__all__ = [  # (the transform types are re-exported: most transforms import them from here)
    *transform_types.__all__,
    "ConfigT",
    "Transform",
    "check_order",
    "TransformRegistry",
    "TRANSFORMS",
    "register",
    "discover_transforms",
]
