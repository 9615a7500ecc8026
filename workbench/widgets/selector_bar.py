"""The row of global selectors (``choices.SELECTORS``): one toggle button per option.

Each option is disabled where it cannot run, with the reason in its tooltip and, shortened, beside
the row; a selector whose transforms are not in the pipeline is disabled as a whole. A press calls
``on_choice(selector, option, pressed)``; ``update`` draws the current values (the panel guards its
handler while it draws).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import ipywidgets as W

from .choices import SELECTORS
from .panes import esc


class SelectorBar:
    def __init__(self, on_choice: Callable[[str, str, bool], None]):
        self.buttons: Dict[str, Dict[str, W.ToggleButton]] = {}
        self.notes: Dict[str, W.HTML] = {}
        rows = []
        for sel in SELECTORS:
            buttons = {}
            for option in sel.options:
                # flex none: a long note beside the row must not squeeze the labels ("torch-si...")
                b = W.ToggleButton(
                    description=option, layout=W.Layout(width=f"{max(64, 9 * len(option) + 30)}px", flex="0 0 auto")
                )
                b.observe(lambda ch, s=sel.name, o=option: on_choice(s, o, ch["new"]), names="value")
                buttons[option] = b
            self.buttons[sel.name], self.notes[sel.name] = buttons, W.HTML()
            label = W.HTML(f"<b>{sel.label}</b>", layout=W.Layout(width="180px", flex="0 0 auto"))
            self.notes[sel.name].layout = W.Layout(flex="1 1 240px", min_width="240px")
            rows.append(W.HBox([label, *buttons.values(), self.notes[sel.name]], layout=W.Layout(flex_flow="row wrap")))
        self.box = W.VBox(rows)

    def update(self, wb: Any, busy: bool) -> None:
        for sel in SELECTORS:
            whole = sel.unavailable(wb.keys)
            present = sel.present(wb.keys)
            if present:
                key, field = present[0]
                current = getattr(wb.entries[wb.index(key)].config, field)
            else:
                current = str(wb.ctx.dtype).replace("torch.", "") if sel.name == "dtype" else None
            notes = [] if whole is None else [whole]
            for option, b in self.buttons[sel.name].items():
                own = sel.reason(option, wb.ctx.device)
                reason = whole or own
                b.value, b.disabled = option == current, busy or reason is not None
                b.tooltip = "; ".join(r for r in (whole, own) if r) or f"{sel.label}: {option}"
                if own is not None:  # the short form here, the whole reason in the tooltip
                    notes.append(f"{option}: {own.partition(': ')[0]}")
            self.notes[sel.name].value = f"<span style='color:#777;font-size:90%'>{esc('; '.join(notes))}</span>"
