"""``workbench run | transforms | check | explore``: the command-line face of the step-through API.

``main`` reads the command line (``cli_parser``), runs one command and ends every failure as one
``error:`` line and an exit status (``cli_errors``). ``workbench run`` is ``cli_run.py``; the smaller
commands (``transforms``, ``check``, ``explore``) are here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any, Callable, Dict, List, Optional

from .cli_errors import EXIT_READER_GONE, say_error, say_interrupted, stdout_reader_gone
from .cli_parser import build_parser
from .cli_run import Terminated, cmd_run, how_stopped


def cmd_transforms(args: argparse.Namespace) -> int:
    from .pipeline import transforms as _t  # noqa: F401  (registers)
    from .pipeline.config import load_default_yaml
    from .pipeline.interface import TRANSFORMS, TransformConfig

    default = load_default_yaml().get("transforms", {})
    common = set(TransformConfig.model_fields)
    for key, cls in TRANSFORMS.items():
        stage = (default.get(key) or {}).get("stage", "-")
        extra = [
            f"{name}: {_ann(f.annotation)} = {f.get_default(call_default_factory=True)!r}"
            if not f.is_required()
            else f"{name}: {_ann(f.annotation)} (required)"
            for name, f in cls.config_class.model_fields.items()
            if name not in common
        ]
        in_default = "default" if key in default else "opt-in"
        module = cls.__module__.replace("workbench.pipeline.transforms.", "transforms/") + ".py"
        print(f"{key:40s} {stage:16s} {in_default:8s} {module:32s} {'; '.join(extra)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Run the registry's entries (export, whole pipeline, cached greedy tokens vs HF), print the table,
    write the reports; exit 0 only when every row passes."""
    from .onboarding import check_registry, exit_code, load_registry, markdown_table, write_reports
    from .onboarding.report import summary_line

    registry = load_registry(args.registry) if args.registry else load_registry()
    only = [o.strip() for o in (args.only or "").split(",") if o.strip()]
    entries, skipped = registry.select(only, quick=args.quick)
    if args.out:
        from .output_dirs import ensure_writable_dir

        ensure_writable_dir(args.out, "--out")  # before minutes of checking, not after
    results = []

    def progress(result, i, n):
        results.append(result)
        verdict = "pass" if result.passed else f"FAIL: {result.failure}"
        print(f"[{i + 1}/{n}] {result.key}: {verdict} ({result.seconds:.1f}s)", file=sys.stderr, flush=True)
        if args.out:  # rewritten after every row: an interrupted check still leaves its rows
            write_reports(results, args.out, skipped)

    check_registry(entries, on_result=progress)
    print(markdown_table(results))
    print(f"\n{summary_line(results, skipped)}")
    if args.out:
        md, html = write_reports(results, args.out, skipped)
        print(f"report: {md} {html}")
    return exit_code(results)


def _ann(a) -> str:
    return a.__name__ if isinstance(a, type) else str(a).replace("typing.", "")


def cmd_explore(args: argparse.Namespace) -> int:
    from .api import Workbench
    from .viz.explorer.command import cmd_explore as run_explore

    return run_explore(args, Workbench)


def leave_triton_unloaded() -> bool:
    """In a process where no Triton kernel can run -- no CUDA device and no ``TRITON_INTERPRET=1`` --
    keep the ``triton`` package from loading; returns whether it did.

    torch imports triton when Dynamo is imported (transformers' model code imports Dynamo) only to
    learn its types: ~72 MB of resident memory (importing Dynamo after torch: +143 MB with triton,
    +71 MB without) for a package that cannot launch a kernel there. ``sys.modules["triton"] =
    None`` makes ``import triton`` raise ImportError, which torch reads as "not installed". Only for a program run (``main()`` with the
    command line's arguments): the process is the CLI's own, unlike a notebook, a test or a
    ``main([...])`` call, whose later work might set ``TRITON_INTERPRET`` and import triton. The
    workbench's Triton ops still say why they cannot run here (``ops/triton_support``: no CUDA and
    no interpreter)."""
    import torch

    if "triton" in sys.modules or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


COMMANDS: Dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "transforms": cmd_transforms,
    "check": cmd_check,
    "explore": cmd_explore,
}


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; every failure ends as one ``error:`` line and an exit status (``cli_errors``).

    ``argv`` None (a program run: the console script, ``python -m workbench.cli``) also leaves
    Triton unloaded where it cannot run (``leave_triton_unloaded``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if argv is None:
        leave_triton_unloaded()
        try:
            signal.signal(signal.SIGTERM, _terminated)  # `kill`, a job scheduler: ends like a Ctrl-C
        except ValueError:
            pass  # not the main thread: signals stay as they are
    args = build_parser().parse_args(argv)  # a usage error: argparse's message and exit status 2
    try:
        status = COMMANDS[args.cmd](args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at interpreter exit
        return status
    except KeyboardInterrupt as e:
        how = how_stopped(e)
        if args.cmd == "check":
            return say_interrupted(None, "during the check: the rows finished so far are above (and in --out)", how=how)
        return say_interrupted(getattr(args, "workbench", None), how=how)
    except BrokenPipeError as e:
        return EXIT_READER_GONE if stdout_reader_gone() else say_error(e, args)
    except Exception as e:  # noqa: BLE001 - the CLI prints one clear line, not a traceback
        return say_error(e, args)


if __name__ == "__main__":
    sys.exit(main())
