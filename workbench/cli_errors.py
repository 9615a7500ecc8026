"""How the CLI ends when something goes wrong: one ``error:`` line and a documented exit status.

The exit statuses (``workbench run --help`` prints them):

====  ==============================================================================
0     the pipeline ran, the answer was printed and every output asked for was written
1     a run failure: a transform or a rank failed, or a --report / --debug-visualize-dir
      output failed after the answer was printed
2     usage or config: a bad flag value, YAML file, model spec, device or directory --
      found before anything is computed
130   interrupted (Ctrl-C): the transforms finished so far are printed, then where it stopped
====  ==============================================================================

Anything else that escapes (a bug in workbench or a library) is one ``error:`` line too, which says so
and how to see the whole trace: ``--traceback`` or ``WORKBENCH_TRACEBACK=1``.

Command-line values are checked here, before a model loads, with the same checks the API applies
(``check_world_size``, ``check_dist_timeout``, ``resolve_dtype``), so that the CLI refuses what the API
refuses, in the same words with the flag's name.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import traceback
from typing import Any, Optional

from .errors import InputError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_READER_GONE = 128 + 13  # as a shell tool killed by SIGPIPE: the output's reader went away
EXIT_TERMINATED = 128 + 15  # SIGTERM: handled as a Ctrl-C, with the status a shell shows for it
TRACEBACK_ENV = "WORKBENCH_TRACEBACK"

EXIT_STATUSES = (
    "exit status: 0 when the pipeline ran, the answer was printed and every output asked for was written; "
    "1 on a run failure (a transform or a rank failed; a --report or --debug-visualize-dir output failed "
    "after the answer was printed); 2 on a usage or config error (bad flag value, YAML, model spec, device, "
    "directory: said before anything runs); 130 when interrupted (Ctrl-C: the finished transforms are "
    "printed, then where it stopped); 143 on SIGTERM (the same, said as terminated); 141 when the output's reader went away (| head), silently. Every failure is one 'error:' line; --traceback (or "
    f"{TRACEBACK_ENV}=1) adds the whole trace. Without graphviz's dot binary the report leaves its pictures "
    "out and the renders are .dot sources (said up front; exit 0)."
)

logger = logging.getLogger("workbench")


def wants_traceback(args: Optional[argparse.Namespace]) -> bool:
    if getattr(args, "traceback", False):
        return True
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def check_run_args(args: argparse.Namespace) -> None:
    """Refuse the ``workbench run`` values the API would refuse (or would take silently and get wrong),
    before a model loads: world size, collective timeout, dtype, tokens to generate, the prompt."""
    from .models.dtypes import resolve_dtype
    from .parallel.group import check_dist_timeout, check_world_size

    if args.world_size is not None:
        check_world_size(args.world_size, "--world-size")
    check_dist_timeout(args.dist_timeout, "--dist-timeout")
    resolve_dtype(args.dtype, "cpu")  # the spelling; "auto" is resolved per device later
    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0 (0: do not generate), got {args.max_new_tokens}")
    if args.max_new_tokens > 0:
        check_prompt(args.prompt)


def check_prompt(prompt: str) -> None:
    """An empty prompt or one that is not UTF-8 is said now, not after minutes of pipeline."""
    if not prompt.strip():
        raise InputError(
            "--prompt is empty: give the text to answer (the default is a question), or --max-new-tokens 0 "
            "to run the pipeline without generating"
        )
    bad = next((i for i, ch in enumerate(prompt) if 0xDC80 <= ord(ch) <= 0xDCFF), None)
    if bad is not None:  # a byte the locale could not decode, kept by Python as a lone surrogate
        raise InputError(
            f"--prompt is not UTF-8 text (byte 0x{ord(prompt[bad]) - 0xDC00:02x} at character {bad}): "
            "pass the prompt in UTF-8 (check the terminal's or the script's encoding)"
        )


def note_flags_that_do_not_apply(args: argparse.Namespace, say: Any) -> None:
    """Flags given for a kind of model this one is not: one line each, so nothing is ignored silently."""
    if args.gguf_weights is None:
        return
    from .models.spec import resolve_spec

    kind = resolve_spec(args.model).kind
    if kind != "gguf":
        say(
            f"note: --gguf-weights {args.gguf_weights} applies to GGUF models; {args.model!r} is "
            f"{'a random tiny model' if kind == 'tiny' else 'an HF checkpoint'}, so it has no effect"
        )


def _one_line_for(e: BaseException) -> tuple[int, str]:
    """The exit status and the ``error:`` text for an exception that ended a command."""
    from .parallel.launcher import RankError
    from .pipeline.interface import TransformError

    if isinstance(e, InputError):
        return EXIT_USAGE, str(e)
    if isinstance(e, TransformError):
        cause = f"{type(e.cause).__name__}: {e.cause}".strip()
        return EXIT_FAILED, (
            f"transform {e.key} (stage {e.stage.value}) failed: {cause}\n"
            f"  the transforms before it finished (table above). Fix its config (--set {e.key}.<field>=<value> "
            f"or --yaml-extra), disable it (--set {e.key}.enabled=false) or let the pipeline go on without "
            f"it (--set {e.key}.skip_on_error=true)"
        )
    if isinstance(e, RankError):  # a rank's error carries the rank's traceback in its text
        return EXIT_FAILED, str(e)
    if isinstance(e, MemoryError):
        return EXIT_FAILED, (
            f"out of memory ({e or 'MemoryError'}): lower max_seq_len / max_batch_size "
            "(--set initialize_cache.max_seq_len=...) or use a smaller model or dtype"
        )
    return EXIT_FAILED, (
        f"unexpected {type(e).__name__}: {e} -- not a known bad input, so probably a bug in workbench or a "
        f"library; run again with --traceback (or {TRACEBACK_ENV}=1) for the whole trace and report it"
    )


def say_error(e: BaseException, args: Optional[argparse.Namespace]) -> int:
    """Print ``e`` as one ``error:`` line (the whole trace first with --traceback); the exit status."""
    if wants_traceback(args):
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    code, text = _one_line_for(e)
    print(f"error: {text}", file=sys.stderr, flush=True)
    return code


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (``workbench transforms | head``).

    A ``BrokenPipeError`` says only that *some* pipe broke; a pipe's write end with no reader polls
    as ``POLLERR``, which tells the CLI's own output apart from, say, a worker's socket. When it is
    gone, standard output is pointed at ``/dev/null`` so the interpreter's final flush stays quiet."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file behind sys.stdout, or no poll here
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone


def say_interrupted(
    wb: Any, before_run: str = "while loading the model: nothing was computed yet", how: str = "interrupted"
) -> int:
    """Ctrl-C (or SIGTERM: ``how``): where the run stopped (the finished transforms were printed as
    the table above); ``before_run`` when there is no Workbench (yet). Status 130, 143 for SIGTERM."""
    if wb is None:
        where = before_run
    elif not wb.done:
        keys = list(wb.keys)
        where = (
            f"at {keys[wb.position]} (transform {wb.position + 1} of {len(keys)}): "
            f"the {wb.position} before it finished (table above)"
        )
    else:
        where = "while generating: the pipeline had finished (table above)"
    print(f"{how} {where}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED if how == "interrupted" else EXIT_TERMINATED


__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_READER_GONE",
    "EXIT_TERMINATED",
    "EXIT_STATUSES",
    "TRACEBACK_ENV",
    "check_run_args",
    "check_prompt",
    "note_flags_that_do_not_apply",
    "say_error",
    "say_interrupted",
    "stdout_reader_gone",
    "wants_traceback",
]
