"""The command line's grammar: ``workbench run | transforms | check | explore``, every flag and its help.

Parsing only: what each subcommand does is in ``cli.py`` (``COMMANDS``), so the flags can be read
(and tested, e.g. their defaults) without the commands' imports."""

from __future__ import annotations

import argparse
from typing import Any

from .cli_errors import EXIT_STATUSES
from .runtime.generate import DEFAULT_PROMPT

DESCRIPTION = "workbench run | transforms | check | explore: the command-line face of the step-through API."


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag; ``args.cmd`` names the subcommand (``cli.COMMANDS`` runs it)."""
    p = argparse.ArgumentParser(prog="workbench", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run", help="run the pipeline on a model and print the per-transform table", epilog=EXIT_STATUSES
    )
    r.add_argument("--model", default="smollm2", help="smollm2 | tiny:<arch> | HF dir | cached HF id")
    r.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16"
    )
    r.add_argument(
        "--gguf-weights",
        choices=("keep", "dequantize"),
        default=None,
        help="GGUF models: keep the file's 4/8-bit weights (default) or dequantize them to fp32 "
        "(other models: a note says it has no effect)",
    )
    r.add_argument(
        "--yaml-extra",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML deep-merged on top of the default pipeline (repeatable)",
    )
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.FIELD=VALUE",
        help="override one config field, e.g. export_to_gm.strict=true (repeatable)",
    )
    r.add_argument(
        "--debug-visualize-dir",
        default=None,
        metavar="DIR",
        help="render every snapshot to DIR/NN_<transform>.svg (.dot sources without graphviz's dot)",
    )
    r.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write a standalone HTML report to DIR/index.html (without graphviz's dot: no graph "
        "pictures); checked before the pipeline, a failure after it is one line and exit 1",
    )
    r.add_argument("--no-numerics", action="store_true", help="skip the per-step numerics probe")
    r.add_argument(
        "--no-export-cache",
        action="store_true",
        help="export the model even when an earlier run exported it with the same code and config "
        "(by default the graph is read from $WORKBENCH_CACHE_DIR/exports)",
    )
    r.add_argument(
        "--no-probe-cache",
        action="store_true",
        help="run every numerics probe, even those an earlier run computed for the same graph, "
        "weights, configs and code (by default they are read from $WORKBENCH_CACHE_DIR/probes)",
    )
    r.add_argument(
        "--verbose",
        action="store_true",
        help="list every transform of the table and every note (default: the ones that changed nothing on "
        "this model are folded into one line per stage)",
    )
    r.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help=f"after the pipeline, generate an answer to this prompt (default: {DEFAULT_PROMPT!r})",
    )
    r.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        metavar="N",
        help="tokens to generate for --prompt (0: do not generate)",
    )
    r.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when a GPU is visible, else CPU) | cpu | cuda (with --world-size N: rank r on cuda:r, NCCL)",
    )
    r.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="run N ranks on torch.distributed (gloo on CPU, NCCL on CUDA); rank 0 prints. "
        "Under torchrun leave it out: torchrun's WORLD_SIZE decides",
    )
    r.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds a rank waits in a collective for its peers before failing (default 300)",
    )
    r.add_argument(
        "--worker-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, in every rank (transforms it registers become usable; repeatable)",
    )
    _traceback_flag(r)
    sub.add_parser("transforms", help="list registered transforms, stages and config fields")
    c = sub.add_parser(
        "check",
        help="run every model of the registry (export, whole pipeline, cached greedy "
        "tokens vs HF) and write a summary report",
    )
    c.add_argument(
        "--registry", default=None, metavar="FILE", help="model registry YAML (default: workbench/models/registry.yaml)"
    )
    c.add_argument(
        "--only",
        default=None,
        metavar="A,B",
        help="check only these entries (labels such as llama, or specs such as tiny:llama); slow ones too",
    )
    c.add_argument("--quick", action="store_true", help="skip the entries marked slow: true")
    c.add_argument("--out", default=None, metavar="DIR", help="write DIR/check_report.md and DIR/check_report.html")
    _traceback_flag(c)
    e = _explore_parser(
        sub,
        "exit status: 0 when stopped with Ctrl-C after serving; 1 when a transform before --at failed; 2 on a "
        "usage error, said before the model loads or before the pipeline runs (a --at/--compare that is not a "
        "transform of the pipeline, a --port in use, Model Explorer not installed: pip install 'workbench[explorer]')",
    )
    _traceback_flag(e)
    return p


def _explore_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    """``workbench explore``'s flags (the command itself: ``viz.explorer.command``)."""
    e = sub.add_parser(
        "explore",
        help="serve a snapshot's graph in Model Explorer (pan, zoom, search, collapsible layers, overlays)",
        epilog=epilog,
    )
    e.add_argument("--model", default="smollm2", help="smollm2 | tiny:<arch> | HF dir | cached HF id")
    e.add_argument("--at", default=None, metavar="KEY", help="the transform whose snapshot to show (default: the last)")
    e.add_argument("--compare", default=None, metavar="KEY", help="a second snapshot, shown side by side")
    e.add_argument("--port", type=int, default=None, metavar="N", help="port to serve on (default: a free one)")
    e.add_argument("--host", default="127.0.0.1", help="interface to serve on (default 127.0.0.1)")
    e.add_argument(
        "--expand",
        action="append",
        default=[],
        metavar="GROUP",
        help="open this group when the page loads, e.g. layers.0/self_attn (repeatable)",
    )
    e.add_argument("--select", default=None, metavar="NODE", help="select this node (by fx name) when the page loads")
    e.add_argument(
        "--out", default=None, metavar="DIR", help="write the graph and overlay files to DIR (default: a temp dir)"
    )
    e.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    e.add_argument("--yaml-extra", action="append", default=[], metavar="FILE", help="YAML merged on the pipeline")
    e.add_argument("--set", action="append", default=[], metavar="KEY.FIELD=VALUE", help="override one config field")
    e.add_argument("--no-numerics", action="store_true", help="skip the per-step numerics probe (no drift overlay)")
    return e


def _traceback_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an error, print the whole Python traceback before the one 'error:' line (also: WORKBENCH_TRACEBACK=1)",
    )
