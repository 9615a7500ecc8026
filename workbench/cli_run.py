"""``workbench run``: load the model, run the pipeline, print its table, generate, write the reports.

One process (``Workbench``), N rank processes behind a ``ShardedWorkbench`` (``--world-size``), or one
rank of a ``torchrun`` launch; whichever, ``_run_and_print`` prints the same lines in the same order
and a failed or interrupted step still leaves the table and the report of what finished. The command
line itself (``main``, the other commands) is ``cli.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import time
from typing import List, Optional

from .cli_errors import check_run_args, note_flags_that_do_not_apply, say_error, say_interrupted
from .errors import InputError
from .run_summary import format_table, pipeline_line, summary_block
from .runtime.compile_cost import compile_line, inductor_state
from .runtime.generate import text_prompt_ids as prompt_token_ids


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so it stops as a Ctrl-C does: the finished steps' table,
    where it stopped, the report of what finished."""


def how_stopped(e: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def _check_outputs(args: argparse.Namespace, rank: int = 0) -> None:
    """An unwritable or full --report / --debug-visualize-dir, and a missing ``dot``, are said before
    the model loads (``viz.run_outputs.check_outputs``), not found after minutes of pipeline."""
    if args.report or args.debug_visualize_dir:  # only then: the check imports workbench.viz
        from .viz.run_outputs import check_outputs

        check_outputs(args.report, args.debug_visualize_dir, rank)


def cmd_run(args: argparse.Namespace) -> int:
    from .parallel.group import torchrun_env

    check_run_args(args)
    ranks = torchrun_env()
    if ranks is not None:  # started by torchrun: this process is one rank, in-process
        return _run_under_torchrun(args, *ranks)
    from .api import Workbench

    world_size = args.world_size or 1
    options = dict(_workbench_options(args), worker_imports=args.worker_import)
    if world_size > 1:  # N rank processes behind one ShardedWorkbench; this process prints
        options.update(world_size=world_size, dist_timeout_s=args.dist_timeout)
    elif not args.worker_import:  # a repeat run reuses probes and the export (not with imported code: it may patch ops)
        options.update(probe_cache=not args.no_probe_cache, export_cache=not args.no_export_cache)
    if not (args.report or args.debug_visualize_dir):
        # The table needs each step's counts, not a copy of its graph (~2.5 MB and ~25 ms per changed
        # step on smollm2); the report and the renders read the graphs.
        options.update(snapshots=False)
    _check_outputs(args)
    note_flags_that_do_not_apply(args, print)
    t0 = time.perf_counter()
    wb = args.workbench = Workbench(args.model, **options)  # main() says where a Ctrl-C stopped it
    # This process runs one pipeline and exits: what is alive now (torch, transformers, the loaded
    # model; ~700k objects for smollm2) stays alive to the end. Frozen, it is left out of the
    # collector's full passes, which otherwise walk all of it: smollm2's pipeline, in process,
    # 3 full passes took 0.72 s of 9.5 s, 0.32-0.36 s frozen (5 smaller passes).
    gc.freeze()
    try:
        load_s = args.load_s = time.perf_counter() - t0
        # world_size > 1: Workbench.__new__ made a ShardedWorkbench, which has these
        where = f", world size {world_size} ({wb.start_method})" if world_size > 1 else ""  # type: ignore[attr-defined]
        print(f"model: {_model_description(wb)} (loaded in {load_s:.1f}s{where})")
        return _run_and_print(wb, args, print)
    finally:
        gc.unfreeze()  # shutdown collects as usual (frozen, Triton's bindings report leaks at exit)
        if world_size > 1:
            wb.close()  # type: ignore[attr-defined]  # a ShardedWorkbench (see above)


def _workbench_options(args: argparse.Namespace) -> dict:
    """The ``Workbench`` keyword arguments `workbench run` takes from its command line."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        yaml_extra=args.yaml_extra,
        overrides=args.set,
        debug_visualize_dir=args.debug_visualize_dir,
        numerics=False if args.no_numerics else None,
        gguf_weights=args.gguf_weights or "keep",
    )


def _run_under_torchrun(args: argparse.Namespace, rank: int, world_size: int, local_rank: int) -> int:
    """One rank of ``torchrun --nproc-per-node N -m workbench.cli run ...``: join the group with
    ``env://``, run the same pipeline as every other rank in this process; rank 0 prints, every rank
    writes its report and renders (ranks > 0 under ``rank<r>/``)."""
    from .parallel.group import GroupSpec, backend_for, destroy_group, init_group, rank_device, threads_per_rank
    from .parallel.worker import build_rank_workbench, import_modules

    if args.world_size and args.world_size != world_size:
        raise InputError(
            f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world_size}: "
            "leave --world-size out under torchrun (its --nproc-per-node decides)"
        )
    import torch

    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    import_modules(args.worker_import)
    say = print if rank == 0 else (lambda *a, **k: None)
    _check_outputs(args, rank)
    dist = init_group(
        rank,
        GroupSpec(world_size, "env://", backend_for(args.device), args.dist_timeout),
        rank_device(args.device, local_rank),
    )
    try:
        t0 = time.perf_counter()
        from .api import Workbench

        wb = args.workbench = build_rank_workbench(
            Workbench, dict(model=args.model, **_workbench_options(args)), dist, local_rank
        )
        say(f"model: {wb.loaded!r} (loaded in {time.perf_counter() - t0:.1f}s, torchrun rank 0 of {world_size})")
        return _run_and_print(wb, args, say, rank=rank)
    finally:
        destroy_group()


def _is_sharded(wb) -> bool:
    """A ``ShardedWorkbench``: the model lives in the rank processes, this process only holds summaries."""
    from .parallel import ShardedWorkbench

    return isinstance(wb, ShardedWorkbench)


def _model_description(wb) -> str:
    return wb.model_description if _is_sharded(wb) else repr(wb.loaded)


def _table_and_report(wb, args: argparse.Namespace, say, rank: int) -> List[str]:
    """Print the table, write the report(s) -- after a failed or interrupted transform; returns the
    report failures as lines. Never raises: an error here must not hide that transform's error."""
    try:
        say(format_table(wb, verbose=args.verbose, keep=_configured_keys(args)))
    except Exception as e:  # noqa: BLE001 - one line after the run's own outcome
        return [f"the table could not be printed ({type(e).__name__}: {e})"]
    return _write_reports(wb, args, say, rank)


def _write_reports(wb, args: argparse.Namespace, say, rank: int) -> List[str]:
    """Write the report(s) when asked; the failures as lines (see run_outputs). Never raises."""
    try:
        if not args.report or (_is_sharded(wb) and wb.closed):
            return []
        from .viz.run_outputs import write_reports

        return write_reports(
            wb, args.report, range(wb.world_size) if _is_sharded(wb) else [rank], say, sharded=_is_sharded(wb)
        )
    except Exception as e:  # noqa: BLE001 - one line after the run's own outcome
        return [f"--report {args.report!r}: the table or report could not be written ({type(e).__name__}: {e})"]


def _configured_keys(args: argparse.Namespace) -> set:
    """The transform keys the user's ``--set`` and ``--yaml-extra`` name: their rows are never folded."""
    from .pipeline.config_yaml import load_yaml_file

    keys = {o.split("=", 1)[0].split(".", 1)[0].strip() for o in args.set}
    for path in args.yaml_extra:
        try:
            keys |= set((load_yaml_file(path).get("transforms") or {}).keys())
        except Exception:  # noqa: BLE001 - the pipeline read it already; a row folded is all that is at stake
            continue
    return keys


def _run_and_print(wb, args: argparse.Namespace, say, rank: int = 0) -> int:
    """Run the pipeline, print the table (via ``say``: a no-op on torchrun ranks > 0), generate,
    write the report (its summary holds the answer), print the summary block. Every rank calls this
    in step: the pipeline and generation have collectives. A failed transform or generation still
    writes the report of what finished, after its own error line.

    The answer comes first: a report or render that failed is one ``error:`` line after it, and
    the exit code is 1 (the user asked for that output and did not get it)."""
    compiled_at_start = inductor_state()  # cumulative per process: this run's share is the difference
    t0 = time.perf_counter()
    try:
        wb.run()
    except (Exception, KeyboardInterrupt) as e:
        # A failing or interrupted transform still leaves a table and a report of everything before it
        # (a sharded run whose ranks were brought down keeps its table; its reports died with the
        # ranks). Its own error comes first and whole; an output that failed too is a line after it.
        failures = _table_and_report(wb, args, say, rank)
        code = say_interrupted(wb, how=how_stopped(e)) if isinstance(e, KeyboardInterrupt) else say_error(e, args)
        _say_failures(failures)
        return code
    wall_s = time.perf_counter() - t0
    say(format_table(wb, verbose=args.verbose, keep=_configured_keys(args)))
    pipeline = pipeline_line(wb, wall_s)
    say(pipeline)
    plan = _plan_rows(wb)
    if plan:
        say(format_plan(plan))
    for snap in wb.snapshots:  # attention left without a KV cache: say which nodes and why, loudly
        left = snap.info.details.get("uncached_attention")
        if left:
            say(
                f"warning: {snap.key}: {len(left)} attention node(s) left uncached, generate re-runs the whole "
                "sequence every step (set insert_cached_attention.require_cached_attention=true to make this an error):"
            )
            for name, why in left.items():
                say(f"  {name}: {why}")
    if args.debug_visualize_dir:
        from .viz.outputs import dot_available

        say(f"renders: {args.debug_visualize_dir}" + ("" if dot_available() else " (Graphviz sources: no dot binary)"))
    compiled_before = inductor_state()
    try:
        out = _generate(wb, args.prompt, args.max_new_tokens, say) if args.max_new_tokens > 0 else None
    except (Exception, KeyboardInterrupt) as e:  # the pipeline's report is still written, after the error
        code = say_interrupted(wb, how=how_stopped(e)) if isinstance(e, KeyboardInterrupt) else say_error(e, args)
        _say_failures(_write_reports(wb, args, say, rank))
        return code
    failures = _write_reports(wb, args, say, rank)  # after the answer: the report's summary holds it
    compiled = compile_line(_compile_model_s(wb), compiled_at_start, compiled_before, inductor_state())
    say(_summary(wb, out, pipeline, getattr(args, "load_s", None), compiled))
    if args.debug_visualize_dir:
        from .viz.run_outputs import render_failures

        failures += render_failures(wb, "--debug-visualize-dir", args.debug_visualize_dir)
    _say_failures(failures)
    return 1 if failures else 0


def _say_failures(failures: List[str]) -> None:
    if failures:
        from .viz.run_outputs import say_failures

        say_failures(failures)


def _plan_rows(wb) -> list:
    if _is_sharded(wb):
        return [] if wb.closed else wb.plan()
    plan = getattr(wb.ctx, "sharding", None)
    return plan.rows() if plan is not None else []


def _layer_ranges(layers: list) -> str:
    if not layers or layers[0] is None:
        return "-"
    spans, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = x
    return ",".join(spans)


def format_plan(rows: list) -> str:
    """The sharding plan: regions that split alike on one line, with the layers they cover."""
    ranks = [k for k in rows[0] if k.startswith("rank ")]
    groups: dict = {}
    for r in rows:
        key = (r["region"], r["split"], r["how"], *(r[k] for k in ranks))
        g = groups.setdefault(key, [[], 0, 0])
        g[0].append(r["layer"])
        g[1] += r["weight bytes"]
        g[2] += r.get("bytes on rank 0", 0)
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    lines = [f"sharding plan ({len(ranks)} ranks; weight bytes whole -> on rank 0):"]
    for (region, split, how, *held), (layers, whole, local) in groups.items():
        per_rank = " | ".join(f"r{i}: {h}" for i, h in enumerate(held))
        lines.append(
            f"  layers {_layer_ranges(layers):>6}  {region:<10} {split:<10} {how}  [{per_rank}]  "
            f"{mib(whole)} -> {mib(local)}"
        )
    return "\n".join(lines)


def _compile_model_s(wb) -> Optional[float]:
    """The compile_model transform's wall time, if it ran in this process."""
    if _is_sharded(wb):
        return None
    snap = next((s for s in wb.snapshots if s.key == "compile_model"), None)
    return snap.times.total if snap is not None else None


def _summary(wb, out, pipeline: str, load_s, compile_cost: Optional[str] = None) -> str:
    """The summary block (``run_summary.summary_block``) of this run."""
    result = out.results[0] if out is not None else None
    answer = None
    if result is not None:
        answer = f"error: {result.error}" if result.error else (result.text or str(result.token_ids))
    weights = cache = None
    if not _is_sharded(wb) and wb.snapshots:
        last = wb.snapshots[-1].mem_after
        weights, cache = last.param_bytes + last.buffer_bytes, wb.ctx.cache_bytes()
    return summary_block(
        answer=answer,
        backends=wb.backends_line(),
        stats=out.stats if out is not None else None,
        weights_bytes=weights,
        cache_bytes=cache,
        load_s=load_s,
        pipeline=pipeline,
        compile_cost=compile_cost,
    )


def _generate(wb, prompt: str, max_new_tokens: int, say=print):
    """The end of `workbench run`: answer ``prompt`` with the compiled model (greedy)."""
    if _is_sharded(wb):
        has_tokenizer, vocab_size = wb.has_tokenizer, wb.vocab_size
    else:
        has_tokenizer, vocab_size = wb.loaded.tokenizer is not None, wb.ctx.vocab_size
    if not has_tokenizer:
        ids = prompt_token_ids(prompt, vocab_size)
        say(f"prompt: {prompt!r} as token ids {ids} ({_spec_of(wb)} has no tokenizer: UTF-8 bytes mod vocab)")
        out = wb.generate([ids], max_new_tokens=max_new_tokens)
    else:
        say(f"prompt: {terminal_safe(prompt)}")
        out = wb.generate(prompt, max_new_tokens=max_new_tokens)
    result = out.results[0]
    if result.error is not None:
        say(f"output: error: {terminal_safe(result.error)}")
    elif result.text is not None:
        say(f"output: {terminal_safe(result.text)}")
    say(f"tokens: {result.token_ids}")
    say(f"generate: {out.stats}")
    return out


# Characters a terminal acts on instead of showing: C0/C1 controls (ESC starts colour and cursor
# sequences) and the bidirectional overrides and isolates (U+202E reverses the rest of the line).
_UNSHOWN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` as the terminal should show it: those characters as ``\\x1b`` / ``\\u202e`` escapes
    (newlines and tabs kept), so a prompt or an answer cannot recolour or reorder the output."""
    return _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _spec_of(wb) -> str:
    return wb.options["model"] if _is_sharded(wb) else wb.loaded.spec
