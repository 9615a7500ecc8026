"""``workbench explore --model M [--at KEY] [--compare KEY] [--port N]``: run the pipeline up to
the snapshot(s) asked for and serve them in Model Explorer until Ctrl-C. (Its flags are declared in
``workbench/cli.py``: building the parser must not import ``workbench.viz``.)

Everything that can be refused is refused before minutes of pipeline: Model Explorer not installed,
a port already taken, a ``--at`` / ``--compare`` that is not a transform of this pipeline (the
error lists the transforms) -- each an ``InputError``, so exit status 2 (``cli_errors``).
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable, List, Optional

from ...errors import InputError
from .require import ExplorerMissingError, require_model_explorer


def _check_key(flag: str, key: Optional[str], keys: List[str]) -> None:
    if key is not None and key not in keys:
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"{flag} {key!r} is not a transform of this pipeline{hint}; its transforms: {', '.join(keys)}")


def cmd_explore(args: argparse.Namespace, workbench_class: Callable[..., Any]) -> int:
    """``workbench_class``: ``workbench.api.Workbench`` (passed in: ``viz`` does not import ``api``)."""
    from .serve import _port_in_use, serve_snapshots

    try:
        require_model_explorer()
    except ExplorerMissingError as e:
        raise InputError(str(e)) from e
    if args.port is not None and not 0 < args.port < 65536:
        raise InputError(f"--port must be 1..65535, got {args.port}")
    if args.port is not None and _port_in_use(args.host, args.port):
        raise InputError(f"--port {args.port}: something already listens on {args.host}:{args.port}")
    wb = args.workbench = workbench_class(
        args.model,
        dtype=args.dtype,
        yaml_extra=args.yaml_extra,
        overrides=args.set,
        numerics=False if args.no_numerics else None,
    )
    _check_key("--at", args.at, wb.keys)
    _check_key("--compare", args.compare, wb.keys)
    wanted = [k for k in (args.at, args.compare) if k is not None]
    if wanted:
        wb.run_to(max(wanted, key=wb.index))
    else:
        wb.run()
    serve_snapshots(
        wb.snapshots,
        wb.keys,
        args.at,
        args.compare,
        out_dir=args.out,
        host=args.host,
        port=args.port,
        expand=args.expand,
        select=args.select or "",
        block=True,
    )
    return 0
