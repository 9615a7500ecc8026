"""The generate box: a prompt, ``Workbench.generate`` streaming into the output, tokens/s.

``generate`` belongs to the KV-cache runtime; a workbench without it gets the box disabled with
the reason. The runtime calls ``stream`` with one event per generated token (``.text``: the newly
decoded text, ``.token_id``) and returns an output with ``.text`` and ``.stats``. A model without
a tokenizer (the ``tiny:`` ones) takes its prompt as token ids, typed as numbers.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, List, Union

import ipywidgets as W

from .panes import error, esc, note

NO_GENERATE = (
    "this Workbench has no generate() yet: generation needs the KV-cache runtime "
    "(cache_init stage), which is not in this build"
)


class GenerationStopped(Exception):
    """Raised from the stream callback when the user pressed Stop."""


def parse_prompt(text: str, has_tokenizer: bool) -> Union[str, List[int]]:
    """The prompt as typed, or as token ids (``"1, 2 3"``) for a model without a tokenizer."""
    if has_tokenizer:
        return text
    try:
        return [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise ValueError("this model has no tokenizer: type the prompt as token ids, e.g. 1 2 3 4") from None


class GenerateBox:
    def __init__(self, start_job: Callable[[Callable[[], None], str], bool], should_stop: Callable[[], bool]):
        self._start_job, self._should_stop = start_job, should_stop
        self.prompt = W.Textarea(placeholder="prompt", layout=W.Layout(width="600px", height="70px"))
        self.max_new_tokens = W.BoundedIntText(
            value=32,
            min=1,
            max=4096,
            description="max new tokens",
            style={"description_width": "110px"},
            layout=W.Layout(width="220px"),
        )
        self.button = W.Button(description="Generate", icon="play", button_style="primary")
        self.button.on_click(lambda _b: self.generate())
        self.output = W.HTML()
        self.output.add_class("wb-generated")
        self.stats = W.HTML()
        self.reason = W.HTML()
        self.box = W.VBox(
            [self.reason, self.prompt, W.HBox([self.max_new_tokens, self.button]), self.stats, self.output]
        )
        self.wb: Any = None

    def update(self, wb: Any, busy: bool) -> None:
        if wb is not self.wb:  # a new workbench (first render, or reloaded in another dtype)
            tokenizer = wb.loaded.tokenizer is not None
            self.prompt.value = "What is the capital of France?" if tokenizer else "1 2 3 4"
            self.prompt.placeholder = "prompt" if tokenizer else "token ids (no tokenizer)"
        self.wb = wb
        available = hasattr(wb, "generate")
        for w in (self.prompt, self.max_new_tokens, self.button):
            w.disabled = busy or not available
        self.reason.value = "" if available else note(NO_GENERATE, "#ef6c00")

    def generate(self) -> bool:
        wb = self.wb
        if not hasattr(wb, "generate"):
            self.output.value = note(NO_GENERATE, "#ef6c00")
            return False
        try:
            prompt = parse_prompt(self.prompt.value, wb.loaded.tokenizer is not None)
        except ValueError as e:
            self.output.value = error(str(e))
            return False
        pieces: List[str] = []
        t0 = time.perf_counter()
        last_draw = [0.0]

        def draw(final: bool = False) -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            self.stats.value = (
                f"{len(pieces)} tokens in {dt:.2f} s &middot; "
                f"<b>{len(pieces) / dt:.1f} tokens/s</b>{'' if final else ' …'}"
            )
            self.output.value = f"<pre>{esc(''.join(pieces))}</pre>"

        def stream(event: Any) -> None:
            if self._should_stop():
                raise GenerationStopped()
            text = getattr(event, "text", "")
            pieces.append(text if text or wb.loaded.tokenizer else f"{event.token_id} ")
            if time.perf_counter() - last_draw[0] > 0.1:  # at most ~10 redraws a second
                last_draw[0] = time.perf_counter()
                draw()

        def job() -> None:
            self.output.value, self.stats.value = "", "generating…"
            try:
                out = wb.generate([prompt], max_new_tokens=self.max_new_tokens.value, stream=stream)
            except GenerationStopped:
                draw(final=True)
                self.stats.value += " &middot; stopped"
                return
            draw(final=True)
            stats = getattr(out, "stats", None)
            if stats is not None:  # the runtime's own count (prefill and decode split)
                self.stats.value += f"<br><small>{esc(stats)}</small>"

        return self._start_job(job, "generating")

    def show_error(self, err: BaseException) -> None:
        self.output.value = error(f"{type(err).__name__}: {err}")
