"""Which code fixed a dynamic dim, when ``torch.export`` refuses a model for it.

A Python loop over the tokens (RWKV's ``for t in range(seq_length)``, any recurrence written step by
step) unrolls to the example's length during tracing, and ``torch.export`` stops with "Constraints
violated (L['input_ids'].size()[1]) ... specialized it to be a constant (8)" -- true, but it names
neither the line nor the module. On that error ``export_to_gm`` traces the model once more with
``draft_export``, which records every guard it had to add with the user stack that added it, and
turns the first guard on the sequence (or batch) dim into one line: the source line, the function,
and the module (its path in the model) whose ``forward`` the stack passed through, e.g.::

    the sequence length was fixed by `for current_index in range(seq_length):` (rwkv_linear_attention_cpu,
    modeling_rwkv.py:180) in model.blocks.0.attention (RwkvSelfAttention): a loop over the tokens ...

The diagnosis runs only on that failure (it costs one more trace) and never hides the original
error: when it finds nothing, ``export_to_gm`` raises torch's message as before.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

#: The phrase of torch's error for a dim marked dynamic that tracing made constant.
SPECIALIZED = "specialized it to be a constant"


#: torch's names of the exported dims (``ExportToGM``'s dynamic shapes) and what they are.
DIM_NAMES = {
    "L['args'][0].size()[1]": "sequence length",
    "L['input_ids'].size()[1]": "sequence length",
    "L['args'][0].size()[0]": "batch size",
    "L['input_ids'].size()[0]": "batch size",
}


def draft_export(module: torch.nn.Module, args: Tuple[Any, ...], dyn) -> Any:
    """``torch.export.draft_export`` (it records the guards a strict export refuses), quietly: its
    warning banner off, and its structured trace (DEBUG records of every traced op) kept to its own
    handler instead of also reaching the application's (or pytest's) log handlers."""
    import logging

    from torch.export._draft_export import draft_export as _draft

    banner, trace = logging.getLogger("torch.export._draft_export"), logging.getLogger("torch.__trace")
    saved = banner.level, trace.propagate
    banner.setLevel(logging.ERROR)
    trace.propagate = False
    try:
        return _draft(module, args, dynamic_shapes=dyn)
    finally:
        banner.setLevel(saved[0])
        trace.propagate = saved[1]


def is_specialized_dim_error(e: BaseException) -> bool:
    return SPECIALIZED in str(e)


def _filenames() -> Dict[int, str]:
    """draft_export's stack frames name their files by index into torch's structured-log intern table."""
    from torch._logging.structured import INTERN_TABLE

    return {i: name for name, i in INTERN_TABLE.items()}


def _code_lines(code) -> Tuple[int, int]:
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return (min(lines), max(lines)) if lines else (code.co_firstlineno, code.co_firstlineno)


def _module_at(model: torch.nn.Module, frames: List[Dict[str, Any]], files: Dict[int, str]) -> Optional[str]:
    """``path (Class)`` of the deepest module whose ``forward`` holds one of the stack's frames."""
    for frame in reversed(frames):
        filename, line = files.get(frame.get("filename")), frame.get("line")
        if frame.get("name") != "forward" or filename is None or line is None:
            continue
        for path, module in model.named_modules():
            code = getattr(type(module).forward, "__code__", None)
            if code is None or os.path.abspath(code.co_filename) != os.path.abspath(filename):
                continue
            first, last = _code_lines(code)
            if first <= line <= last:
                return f"{path or '(the model)'} ({type(module).__name__})"
    return None


def explain_specialized_dim(model: torch.nn.Module, draft: Callable[[], Any], dims: Dict[str, str]) -> Optional[str]:
    """One line naming the code that fixed a dynamic dim, from ``draft()`` (a ``draft_export`` of the
    same module and inputs, under the same patches); ``dims`` maps torch's source strings of the
    dynamic dims (``"L['input_ids'].size()[1]"``) to what they are ("sequence length"). None when the
    draft trace finds no such guard (or fails itself)."""
    try:
        ep = draft()
    except Exception:  # noqa: BLE001 - the diagnosis is extra; the caller raises torch's error
        return None
    files = _filenames()
    for failure in getattr(getattr(ep, "_report", None), "failures", []):
        data = getattr(failure, "data", {}) or {}
        sources = data.get("symbol_to_sources", {}) or {}
        dim = next((dims[s] for s in sources.values() if s in dims), None)
        frames = data.get("user_stack") or data.get("stack") or []
        if dim is None or not frames:
            continue
        top = frames[-1]
        where = f"{top.get('name')}, {os.path.basename(files.get(top.get('filename'), '?'))}:{top.get('line')}"
        module = _module_at(model, frames, files)
        return (
            f"the {dim} was fixed during tracing by `{str(top.get('loc', '')).strip()}` ({where})"
            + (f" in {module}" if module else "")
            + f" ({data.get('expr', 'a guard')}): a Python loop over the tokens (a recurrence written step by "
            "step) unrolls to the example's length, so the graph would only run that length. This block needs "
            "a canonical op and an export patch (workbench/models/canonical) before the model can be exported"
        )
    return None
