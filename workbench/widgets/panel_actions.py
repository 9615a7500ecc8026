"""What the panel's buttons, checkboxes and selectors do: the action half of ``WorkbenchPanel``.

Every action calls the workbench (``step``, ``configure``, ``enable``, ``rewind``, ``reset``, a
reload through ``with_options``) on the panel's worker and then ``render()``s; the drawing half is
``panel.py``. Kept as a mixin so each half stays one readable file.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import ipywidgets as W

from ..pipeline.config import ConfigError
from ..pipeline.interface import TransformError
from . import panes
from .choices import SELECTORS
from .config_form import ConfigForm, FormError

if TYPE_CHECKING:
    from ..pipeline.snapshot import Snapshot
    from .generate_box import GenerateBox
    from .pipeline_list import PipelineList
    from .worker import Worker


class PanelActions:
    """Handlers of ``WorkbenchPanel`` (which provides the widgets, ``wb``, ``worker`` and ``render``)."""

    wb: Any
    # what WorkbenchPanel sets up (declared for the type checker; the panel owns them)
    worker: Worker
    svgs: panes.SvgCache
    generate_box: GenerateBox
    pipeline: PipelineList
    auto_rerun: W.Checkbox
    message: W.HTML
    explorer: W.HTML
    config_error: W.HTML
    seen: Dict[str, Snapshot]
    _pane_key: Any
    _form: Optional[ConfigForm]
    _rendering: bool

    if TYPE_CHECKING:

        def render(self) -> None: ...

        def _say(self, text: str, color: str = "#333") -> None: ...

        def _render_config(self) -> None: ...

    def _start_job(self, job: Callable[[], None], what: str, after: Callable[[], None] = lambda: None) -> bool:
        def done(err: Optional[BaseException]) -> None:
            if err is not None:
                if what == "generating":
                    self.generate_box.show_error(err)
                self._say(f"{what} failed: {type(err).__name__}: {err}"[:600], "#c62828")
            after()
            self.render()

        started = self.worker.start(job, done)
        if not started:
            self._say("busy: wait for the running job or press Stop", "#ef6c00")
        return started

    def run_to_position(self, target: int, follow: bool = True) -> bool:
        """Step until ``target`` transforms have run (or Stop); the core of every run button."""
        wb = self.wb
        target, n, t0 = min(target, len(wb.entries)), len(wb.entries), time.perf_counter()
        self._goal = target
        ran: List[str] = []

        def job() -> None:
            while wb.position < target and not self.worker.stop_requested:
                self._say(f"running {wb.keys[wb.position]} ({wb.position + 1}/{n})…", "#1565c0")
                ran.append(wb.step().key)
                self.render()

        def after() -> None:
            if follow and ran:
                self.selected = ran[-1]
            if isinstance(wb.last_error, TransformError) and wb.last_error.key not in ran:
                self.selected = wb.last_error.key
            if wb.last_error is None:
                dt = time.perf_counter() - t0
                stopped = " (stopped)" if self.worker.stop_requested and wb.position < target else ""
                self._say(f"ran {len(ran)} transform(s) in {dt:.1f} s{stopped}")

        return self._start_job(job, "running", after)

    def step(self) -> bool:
        return self.run_to_position(self.wb.position + 1)

    def run_to_selected(self) -> bool:
        i = self.wb.index(self.selected)
        if i < self.wb.position:
            self._say(f"{self.selected} has already run: Rewind to run it again")
            return False
        return self.run_to_position(i + 1)

    def run_all(self) -> bool:
        return self.run_to_position(len(self.wb.entries))

    def stop(self) -> None:
        self.worker.stop()
        self._say("stopping after the current transform…", "#ef6c00")

    def rewind(self) -> None:
        if self.wb.index(self.selected) >= self.wb.position:
            self._say(f"{self.selected} has not run: nothing to rewind")
        else:
            self.render()  # record what is shown now, so the rewound steps show as stale
            self.wb.rewind(self.selected)
            self._say(f"rewound: {self.selected} runs next")
        self.render()

    def reset(self) -> None:
        self.wb.reset()
        self.seen.clear()
        self.svgs.clear()
        self._say("reset to the eager model: the next step re-exports")
        self.render()

    def explore_selected(self) -> Optional[str]:
        """Open the selected snapshot in Model Explorer below the Graph tab's picker (an iframe on a
        local server, ``Workbench.explore``'s); the URL, or None with the reason said."""
        from ..viz.explorer import ExplorerMissingError, serve_snapshots

        if self.wb.index(self.selected) >= self.wb.position:
            self._say(f"{self.selected} has not run yet: run to it first, then open it in Model Explorer")
            return None
        try:
            server = serve_snapshots(self.wb.snapshots, self.wb.keys, self.selected)
        except ExplorerMissingError as e:
            self._say(str(e), "#c62828")
            return None
        link = f"<a href='{server.url}' target='_blank'>open in a new tab</a>"
        self.explorer.value = (
            f"<div>{panes.esc(self.selected)} in Model Explorer &middot; {link}</div>"
            f"<iframe src='{server.url}' style='width:100%;height:720px;border:1px solid #ccc'></iframe>"
        )
        self._say(f"{self.selected}: opened in Model Explorer")
        return server.url

    def _edit(self, change: Callable[[], object], where: W.HTML) -> bool:
        """Apply one edit through the API; on success re-run back to where the pipeline was."""
        if self.worker.busy:
            self._say("busy: wait for the running job or press Stop", "#ef6c00")
            self.render()
            return False
        self.render()  # record the snapshots the edit may invalidate (shown stale afterwards)
        before = self.wb.position
        # After a failed run, an edit (often the fix) resumes that run; otherwise the pipeline
        # goes back to where it was.
        goal = max(before, self._goal) if self.wb.last_error is not None else before
        try:
            change()
        except (ConfigError, KeyError, ValueError) as e:
            where.value = panes.error(str(e))
            self.render()
            return False
        where.value = ""
        if self.auto_rerun.value and self.wb.position < goal:
            return self.run_to_position(goal, follow=False)
        self._say(
            f"{before - self.wb.position} snapshot(s) invalidated: stale until re-run"
            if self.wb.position < before
            else "changed (nothing had run past it)"
        )
        self.render()
        return True

    def _on_toggle(self, key: str, enabled: bool) -> None:
        if self._rendering:
            return
        self._edit(lambda: self.wb.enable(key, enabled), self.message)

    def toggle(self, key: str, enabled: bool) -> None:
        """Tick or untick a transform's checkbox, as a user would."""
        self.pipeline.checkboxes[key].value = enabled

    def apply_config(self) -> bool:
        """Apply the config form's changed fields to the selected transform."""
        self._render_config()
        assert self._form is not None  # _render_config built it
        try:
            changes = self._form.changes()
        except FormError as e:
            self.config_error.value = panes.error(str(e))
            return False
        if not changes:
            self.config_error.value = panes.note("nothing changed")
            return False
        key = self.selected
        return self._edit(lambda: self.wb.configure(key, **changes), self.config_error)

    @property
    def form(self) -> ConfigForm:
        """The config form of the selected transform."""
        self._render_config()
        assert self._form is not None  # _render_config built it
        return self._form

    def _on_choice(self, selector: str, option: str, pressed: bool) -> None:
        if self._rendering:
            return
        if pressed:
            self.pick(selector, option)
        else:  # un-pressing the current option changes nothing: draw it pressed again
            self.render()

    def pick(self, selector: str, option: str) -> bool:
        """Choose a global selector option (attention/compile backend, layout, dtype)."""
        sel = next(s for s in SELECTORS if s.name == selector)
        reason = sel.unavailable(self.wb.keys) or sel.reason(option, self.wb.ctx.device)
        if reason is not None:
            self._say(f"{sel.label} {option}: {reason}", "#ef6c00")
            self.render()
            return False
        if sel.name == "dtype":
            return self._reload(option)
        wb = self.wb
        return self._edit(lambda: [wb.configure(k, **{f: option}) for k, f in sel.present(wb.keys)], self.message)

    def _reload(self, dtype: str) -> bool:
        """Load the model again in ``dtype``: the panel then drives a new Workbench (``panel.wb``)."""
        old = self.wb
        if str(old.ctx.dtype) == f"torch.{dtype}":
            return False
        target = old.position if self.auto_rerun.value else 0

        def job() -> None:
            self._say(f"loading {old.ctx.spec} in {dtype}…", "#1565c0")
            # every constructor argument kept (limits, device, numerics...), the configured pipeline too
            new = old.with_options(dtype=dtype, entries=list(old.entries))
            self.wb, self.seen, self._pane_key = new, {}, None
            self.svgs.clear()
            while new.position < target and not self.worker.stop_requested:
                new.step()
                self.render()

        def after() -> None:
            if self.wb is not old:
                self._say(
                    f"reloaded in {dtype}: the panel now drives panel.wb, a new Workbench "
                    f"(the one you passed keeps {str(old.ctx.dtype).replace('torch.', '')})"
                )

        return self._start_job(job, f"reloading in {dtype}", after)
