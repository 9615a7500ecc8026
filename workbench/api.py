"""The user-facing ``Workbench``: a pipeline stepper over a model spec, plus the extras a user
expects in a notebook (renders into ``debug_visualize_dir``, a table, later the runtime and UI).

The engine is ``workbench.pipeline.stepper.PipelineStepper``; this class only wires things that
the pipeline package must not import itself (viz).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .answer import answer, backends_line
from .models import LoadedModel, load_model
from .models.devices import AUTO, model_device, resolve_device
from .output_dirs import LOW_FREE_BYTES, MIN_FREE_BYTES, ensure_writable_dir
from .pipeline.config import apply_global_field, resolve_pipeline
from .pipeline.interface import TRANSFORMS
from .pipeline.snapshot import Snapshot
from .pipeline.stepper import PipelineStepper
from .pipeline.transforms.caches.fit import check_limits_early
from .runtime.generate import DEFAULT_PROMPT

logger = logging.getLogger("workbench")
_STEPPER_ARGS = frozenset(inspect.signature(PipelineStepper.__init__).parameters) - {"self", "loaded"}


@dataclass
class RenderFailure:
    """A ``debug_visualize_dir`` render that could not be written: the pipeline went on without it."""

    index: int  # the snapshot's
    key: str
    error: str  # "OSError: [Errno 28] No space left on device"
    fix: str  # what to do about it

    @property
    def message(self) -> str:
        return f"render of #{self.index:02d} {self.key} failed ({self.error}); {self.fix}"


class Workbench(PipelineStepper):
    """Step through the compilation pipeline of one model.

    >>> wb = Workbench("tiny:llama")
    >>> wb.step()            # export_to_gm
    >>> wb.run()             # the rest
    >>> wb.table()           # per-transform matches, time, memory, numerics
    """

    def __new__(cls, *args: Any, world_size: int = 1, **kwargs: Any):
        """``Workbench(..., world_size=N)`` with N > 1 is a ``workbench.parallel.ShardedWorkbench``:
        N rank processes, each with this class (a subclass too) at world size 1 plus ``dist``, run the
        pipeline in lockstep on ``torch.distributed``; world size 1 is this class, in this process."""
        if world_size != 1:
            from .parallel import ShardedWorkbench

            return ShardedWorkbench(*args, world_size=world_size, workbench_class=cls, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model: Union[str, LoadedModel] = "smollm2",
        *,
        dtype: Union[str, torch.dtype] = "auto",
        device: Union[str, torch.device] = "auto",
        yaml_extra: Sequence[Union[str, Mapping[str, Any]]] = (),
        overrides: Union[Mapping[str, Any], Iterable[str]] = (),
        debug_visualize_dir: Optional[str] = None,
        seed: int = 0,
        gguf_weights: str = "keep",
        custom_models: Union[bool, Mapping[str, type]] = True,
        world_size: int = 1,
        worker_imports: Sequence[str] = (),
        **kwargs: Any,
    ):
        """``device``: ``"auto"`` (default) is CUDA when torch sees a GPU, else the CPU; ``"cpu"`` /
        ``"cuda"`` ask for one (a ``LoadedModel`` with ``"auto"``: the device its weights are on).
        ``dtype``: ``"auto"`` (default) is bfloat16 on CUDA, float32 on the CPU (ignored for a ``LoadedModel``,
        which has its dtype).
        ``world_size`` > 1: see ``__new__`` (a ``ShardedWorkbench``; it also takes
        ``dist_timeout_s`` and ``start_method``). ``worker_imports``: modules to import first (user
        transforms register there); with world_size > 1 every rank imports them too.
        ``gguf_weights`` (GGUF models such as smollm2): ``"keep"`` the file's quantized weights
        (int4/int8 ops) or ``"dequantize"`` them to fp32. ``custom_models``: export the custom
        canonical-op model registered for the config class (``workbench.models.custom``), if any,
        instead of the HF class (HF's eager model stays the numerics reference either way), or a mapping
        {config class name: model class} of the custom models to use (e.g. the sharding-aware ones).
        ``kwargs`` go to ``PipelineStepper``: ``max_batch_size``, ``max_seq_len``,
        ``max_num_tokens``, ``page_size`` (the runtime limits), ``numerics``, ``snapshots``,
        ``probe_shape``, ``on_snapshot``, ``entries``, ``registry``."""
        if world_size != 1:  # only reached by calling __init__ directly: __new__ dispatched already
            raise ValueError(
                f"{type(self).__name__}.__init__ builds one process (world_size=1); create "
                f"{type(self).__name__}(..., world_size={world_size}) for a sharded run"
            )
        if worker_imports:
            from .parallel.worker import import_modules

            import_modules([worker_imports] if isinstance(worker_imports, str) else worker_imports)
        unknown = sorted(set(kwargs) - _STEPPER_ARGS)
        if unknown:  # said as Workbench's, with the nearest names, not as PipelineStepper's TypeError
            known = sorted((set(inspect.signature(Workbench.__init__).parameters) | _STEPPER_ARGS) - {"self", "kwargs"})
            near = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
            hints = "".join(f" ({u!r}: did you mean {m[0]!r}?)" for u, m in near.items() if m)
            raise TypeError(f"Workbench: unknown option(s) {unknown}{hints}; known: {known}")
        # Everything the caller gave, so that with_options() can build the same Workbench again.
        self.options: Dict[str, Any] = dict(
            model=model,
            dtype=dtype,
            device=device,
            yaml_extra=yaml_extra,
            overrides=overrides,
            debug_visualize_dir=debug_visualize_dir,
            seed=seed,
            gguf_weights=gguf_weights,
            custom_models=custom_models,
            worker_imports=worker_imports,
            **kwargs,
        )
        # Check what can be checked before any weight is loaded: a typo should fail in milliseconds.
        if isinstance(model, LoadedModel) and str(device).strip().lower() == AUTO:
            device = model_device(model.model)  # "auto" with a loaded model: where its weights are
        device = resolve_device(device)
        registry = kwargs.pop("registry", TRANSFORMS)
        entries = kwargs.pop("entries", None) or resolve_pipeline(yaml_extra, overrides, registry)
        if debug_visualize_dir is not None:
            ensure_writable_dir(
                debug_visualize_dir, "debug_visualize_dir", min_free=MIN_FREE_BYTES, low_free=LOW_FREE_BYTES
            )
            entries = apply_global_field(entries, "debug_visualize_dir", debug_visualize_dir)
            self._say_how_renders_are_written(debug_visualize_dir, kwargs.get("dist"))
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model, dtype=dtype, device=device, seed=seed, gguf_weights=gguf_weights, custom_models=custom_models
            )
        )
        # Held by whatever drives this Workbench's runner and caches (generate, answer, a pipeline
        # step), so calls from several threads (a panel's background run, notebook cells) take turns:
        # every generate allocates pages from page 0 of the one set of cache tensors, so two at once
        # write into each other's K/V. Re-entrant: generate runs the pipeline under it. Per
        # Workbench, so a new one (a re-run cell) never waits for an old one.
        self.runtime_lock = threading.RLock()
        super().__init__(loaded, entries=entries, device=device, registry=registry, **kwargs)
        # The limits against memory now, with the K/V bytes estimated from the config: a limit too
        # large fails here, naming it, instead of in initialize_cache after the pipeline ran to it.
        check_limits_early(
            self.entries, self.limits, loaded.config, self.ctx.dtype, self.ctx.device, self.ctx.dist.world_size
        )
        # Renders that failed (disk full, a permission change, a bug in viz): the pipeline goes on.
        self.render_failures: List[RenderFailure] = []
        self.last_generation: Any = None  # the GenerationOutput of the last generate() call
        # (final module, compiled runner, cache tensors, cache config) -> the runner built for them: building one runs
        # the cache check (three forwards), which the next generate on the same pipeline need not repeat
        self._runner_memo: Optional[Tuple[Tuple[Any, ...], Any]] = None
        self.on_snapshot.append(self._visualize)

    def with_options(self, **changes: Any) -> "Workbench":
        """A new Workbench built with this one's constructor arguments, ``changes`` applied.

        ``wb.with_options(dtype="bfloat16", entries=list(wb.entries))`` reloads the model in another
        dtype and keeps the configured pipeline and every other argument (limits, device, numerics,
        ...). A model passed as a ``LoadedModel`` is loaded again from its spec when the dtype,
        device or seed changes.
        """
        unknown = sorted(set(changes) - set(inspect.signature(Workbench.__init__).parameters) - _STEPPER_ARGS)
        if unknown:
            raise TypeError(
                f"with_options: unknown option(s) {unknown}; known: "
                f"{sorted((set(inspect.signature(Workbench.__init__).parameters) | _STEPPER_ARGS) - {'self', 'kwargs'})}"
            )
        args = {**self.options, **changes}
        if isinstance(args["model"], LoadedModel) and {"dtype", "device", "seed", "custom_models"} & set(changes):
            args["model"] = args["model"].spec
        return Workbench(**args)

    def ui(self):
        """The notebook panel over this workbench (``workbench.widgets.WorkbenchPanel``).

        End a cell with it, or ``display(wb.ui())``; needs ipywidgets (the ``notebooks`` extra).
        """
        from .widgets import WorkbenchPanel

        return WorkbenchPanel(self)

    def explore(
        self,
        key: Optional[str] = None,
        compare: Optional[str] = None,
        *,
        overlays: Optional[Mapping[str, Mapping[str, float]]] = None,
        expand: Sequence[str] = (),
        select: str = "",
        port: Optional[int] = None,
        height: int = 800,
    ) -> Optional[str]:
        """Open snapshot ``key`` (default: the last one run) in Google's Model Explorer: pan, zoom,
        search, one collapsible group per decoder layer and sub-module, and the overlays painted on
        the nodes (what the transform changed, numerics drift, and ``overlays``: {name: {node name:
        value}}, e.g. a cost). ``compare``: a second snapshot, shown side by side. ``expand``: groups
        to open (``["layers.0/self_attn"]``); ``select``: a node to select (its attributes shown).

        In a notebook it shows the viewer in the cell's output and returns None; elsewhere it returns
        the URL of the server (a daemon thread of this process: it serves until the process ends).
        Needs the ``explorer`` extra (``pip install 'workbench[explorer]'``); ``workbench.viz.explorer``.
        """
        from .viz.explorer import serve_snapshots

        server = serve_snapshots(
            self.snapshots, self.keys, key, compare, overlays=overlays, expand=expand, select=select, port=port
        )
        try:
            from IPython import get_ipython
        except ImportError:
            return server.url
        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            return server.url
        from IPython.display import HTML, display

        display(server.embed(height), HTML(f"<a href='{server.url}' target='_blank'>open in a new tab</a>"))
        return None

    @staticmethod
    def _say_how_renders_are_written(out_dir: str, dist: Any) -> None:
        """Without graphviz's ``dot`` the renders are Graphviz sources: say so once, before the model
        loads (rank 0 only in a sharded run: one line, not one per rank)."""
        if dist is not None and getattr(dist, "rank", 0) != 0:
            return
        try:
            from .viz.outputs import dot_available, renders_notice, warn_once
        except ImportError:  # said by _visualize, with the reason
            return
        if not dot_available():
            warn_once("renders-no-dot", renders_notice(out_dir))

    def _visualize(self, snap: Snapshot) -> None:
        """Write the snapshot's render when its transform has ``debug_visualize_dir`` set.

        A render is a debugging aid: one that fails is recorded in ``render_failures`` and warned
        about once, and the pipeline goes on (minutes of pipeline are not lost to a full disk)."""
        out_dir = snap.config.debug_visualize_dir
        if not out_dir or snap.module is None:
            return
        try:
            from .viz.outputs import explain_failure, write_snapshot_render
        except ImportError as e:  # viz is optional at this layer; say so instead of failing
            logger.warning("debug_visualize_dir set but workbench.viz is unavailable: %s", e)
            return
        try:
            write_snapshot_render(snap, out_dir)
        except Exception as e:  # noqa: BLE001 - any failure of a render must not end the pipeline
            failure = RenderFailure(snap.index, snap.key, *explain_failure(e, "debug_visualize_dir"))
            self.render_failures.append(failure)
            if len(self.render_failures) == 1:
                logger.warning(
                    "debug_visualize_dir %r: %s; the pipeline goes on (later failures are only "
                    "recorded in render_failures)",
                    str(out_dir),
                    failure.message,
                )

    # ------------------------------------------------------------------ generation (runtime)
    # The pipeline's steps run under runtime_lock too: the cache and compile stages allocate the
    # caches and build the runner that a generate reads, and run/run_to check where the pipeline
    # is before stepping (another thread's generate may have run it to the end in between).
    def step(self) -> Snapshot:
        with self.runtime_lock:
            return super().step()

    def run(self) -> List[Snapshot]:
        with self.runtime_lock:
            return super().run()

    def run_to(self, key: str) -> List[Snapshot]:
        with self.runtime_lock:
            return super().run_to(key)

    def invalidate(self, index: int) -> None:
        """``PipelineStepper.invalidate`` under ``runtime_lock``: it swaps the live graph and caches."""
        with self.runtime_lock:
            super().invalidate(index)

    def generate(self, prompts: Any, max_new_tokens: int = 64, **kwargs: Any):
        """Generate text for one prompt or a list of them on the compiled model.

        Runs the rest of the pipeline first if it has not finished. Prompts are strings (chat
        template applied when the tokenizer has one), chat message lists or token-id lists;
        several prompts are continuously batched. ``kwargs`` go to ``workbench.runtime.generate``
        (temperature, top_k, top_p, stop_token_ids, stream, seed, truncate_prompt, chat_template).
        Returns a ``GenerationOutput`` (``.text``, ``.texts``, ``.results``, ``.stats`` with tokens/s).

        Calls from several threads take turns (``runtime_lock``): each one's prompts get the whole
        cache, so batch prompts into one call to run them together.
        """
        from .runtime.generate import generate
        from .runtime.prompts import default_stop_token_ids
        from .runtime.runner_for import runner_for

        with self.runtime_lock:
            if not self.done:
                self.run()
            tokenizer = self.loaded.tokenizer
            if "stop_token_ids" not in kwargs:
                gen_cfg = getattr(self.loaded.model, "generation_config", None)
                kwargs["stop_token_ids"] = default_stop_token_ids(tokenizer, gen_cfg)
            runner = self._runner_for_generate(runner_for)
            out = generate(
                runner,
                prompts,
                tokenizer=tokenizer,
                vocab_size=self.ctx.vocab_size,
                max_new_tokens=max_new_tokens,
                **kwargs,
            )
            self.last_generation = out  # the report's summary shows the last answer and its speed
            return out

    def _runner_for_generate(self, build: Any) -> Any:
        """``build(module, ctx)`` (``runtime.runner_for.runner_for``) once per finished pipeline: the same
        final module, compiled runner and cache reuse the runner (and its passed cache check)."""
        cache = self.ctx.cache
        key = (self.module, self.ctx.runner, cache.tensors, cache.config)
        memo = self._runner_memo
        same = memo is not None and all(a is b for a, b in zip(memo[0][:3], key[:3])) and memo[0][3] == key[3]
        if memo is None or not same:
            memo = self._runner_memo = (key, build(self.module, self.ctx))
        return memo[1]

    def backends_line(self) -> str:
        """Where and how the finished pipeline runs, and why: device and dtype, the cached-attention
        and compile backends with the reason each was chosen, and once generation ran, how the plain
        runner steps the graph (one line)."""
        line = backends_line(self, self._where())
        form = getattr(self._runner_memo[1], "step_form", "module") if self._runner_memo is not None else "module"
        return line if form == "module" else f"{line}; steps as a {form}"

    def _where(self) -> str:
        return f"{self.ctx.device.type} {str(self.ctx.dtype).replace('torch.', '')}"

    def answer(self, prompt: Any = DEFAULT_PROMPT, max_new_tokens: int = 32, **kwargs: Any):
        """Run the compiled model on one prompt (greedy) and print which backends ran, the answer and
        its speed -- the last cell of every notebook. A model without a tokenizer (``tiny:``) gets a
        text prompt as UTF-8 byte ids. ``kwargs`` go to ``generate``; returns its ``GenerationOutput``."""
        with self.runtime_lock:  # the runner it reports on is the one its generate runs
            if not self.done:
                self.run()
            return answer(
                self,
                prompt,
                max_new_tokens,
                self._where(),
                self.loaded.tokenizer is not None,
                self.ctx.vocab_size,
                self.ctx.runner,
                **kwargs,
            )

    def cost_table(
        self,
        key: Optional[str] = None,
        device: str = "h100",
        phase: str = "decode",
        measure: bool = False,
        threads: Optional[int] = None,
    ):
        """Per op category of snapshot ``key``'s graph (None: the live graph): GFLOP, MB moved,
        launches and the roofline time on ``device`` ("h100": datasheet; "this-cpu": measured here)
        for one ``phase`` ("decode": ms per step of the 512th token; "prefill": us per token of a
        512-token prompt); ``measure=True`` adds the time measured here per category (torch.profiler,
        ``threads`` intra-op threads). A DataFrame; ``workbench.analysis.cost`` has the per-node rows."""
        from .analysis.cost import category_table, measure_categories, node_costs

        with self.runtime_lock:
            mod = self.snapshot(key).module if key is not None else self.module
            frame = node_costs(mod, phase, device, threads)
            measured = measure_categories(self, key, phase, threads=threads) if measure else None
        return category_table(frame, phase, measured)


# help(Workbench) and notebook tooltips: __init__'s parameters, not __new__'s (*args, world_size, **kwargs).
Workbench.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    Workbench.__init__
).replace(parameters=list(inspect.signature(Workbench.__init__).parameters.values())[1:])
