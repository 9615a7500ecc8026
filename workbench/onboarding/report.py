"""The summary report of ``workbench check``: one row per registry entry, as Markdown and as HTML.

Columns: entry | model | family | reached stage | cached? | tokens equal HF | HF distinct tokens | worst
probe RMSE | time (s) | result. "HF distinct tokens" is the oracle's strength: the fewest distinct tokens
in HF's greedy continuation of any prompt (a weak oracle fails the row). A failing row says why in its own cells (the stage and transform that stopped it with the error's
first line, the attention left uncached, the first token that differs), so the table alone is enough to
decide what to look at next.
"""

from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import List, Sequence, Tuple, Union

from .check import CheckResult, CheckSettings
from .entry_details import details_html, details_markdown
from .registry import RegistryEntry

COLUMNS = (
    "entry",
    "model",
    "family",
    "reached stage",
    "cached?",
    "tokens equal HF",
    "HF distinct tokens",
    "worst probe RMSE",
    "time (s)",
    "result",
)


def row_cells(r: CheckResult) -> List[str]:
    """The row of one result, as plain text cells in ``COLUMNS`` order."""
    return [
        r.key,
        r.model,
        r.family,
        _reached(r),
        _cached(r),
        r.tokens or "-",
        _oracle(r),
        _probe(r),
        f"{r.seconds:.1f}",
        "pass" if r.passed else f"FAIL: {r.failure}",
    ]


def _reached(r: CheckResult) -> str:
    count = f"{r.transforms_run}/{r.transforms_total} transforms"
    if not r.stopped_at or r.stopped_at in ("generate",):
        text = f"end ({count})"
        if r.skipped_on_error:
            text += f"; failed but skipped (skip_on_error): {', '.join(r.skipped_on_error)}"
        return text + (f"; generate: {r.error}" if r.error else "")
    if r.stopped_at in ("load", "config", "hf reference", "internal error"):
        return f"{r.stopped_at}: {r.error}"
    return f"stopped at {r.stopped_at} ({count}): {r.error}"


def _cached(r: CheckResult) -> str:
    if r.transforms_run == 0:
        return "-"
    parts = []
    if r.uncached_attention:
        whys = sorted(set(r.uncached_attention.values()))
        parts.append(
            f"NO: {len(r.uncached_attention)} attention node(s) left without a KV cache ({whys[0]}"
            + (f"; +{len(whys) - 1} other reason(s))" if len(whys) > 1 else ")")
        )
    parts.append(", ".join(r.cache_kinds) or "no cache inserted")
    if r.runner_cache:
        parts.append(f"runner: {r.runner_cache}")
    return "; ".join(parts)


def _oracle(r: CheckResult) -> str:
    if r.oracle_tokens is None:
        return "-"
    return f"{r.oracle_tokens}" + (f" (weak: < {r.min_oracle_tokens})" if r.weak_oracle else "")


def _probe(r: CheckResult) -> str:
    text = f"{r.worst_rmse:.1e} ({r.worst_rmse_at})" if r.worst_rmse is not None else "-"
    return text + (f"; {r.probe_errors} probe(s) could not run" if r.probe_errors else "")


def summary_line(results: Sequence[CheckResult], skipped: Sequence[RegistryEntry] = ()) -> str:
    passed = sum(r.passed for r in results)
    line = f"{passed} of {len(results)} entries pass"
    if skipped:
        line += f"; {len(skipped)} slow entr{'y' if len(skipped) == 1 else 'ies'} skipped (--quick): " + ", ".join(
            e.key for e in skipped
        )
    return line


# The settings a report names when none are given (CheckSettings is never mutated).
DEFAULT_SETTINGS = CheckSettings()


def settings_line(settings: CheckSettings) -> str:
    import torch
    import transformers

    return (
        f"{len(settings.prompt_lens)} prompts of {', '.join(map(str, settings.prompt_lens))} random token ids, "
        f"{settings.max_batch_size} at a time (continuous batching), {settings.new_tokens} greedy new tokens "
        f"each, fp32, compared with HF generate on the same weights (each prompt alone; HF's continuation of "
        f"every prompt must hold at least {settings.min_oracle_tokens} distinct tokens); torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {datetime.datetime.now().isoformat(timespec='seconds')}"
    )


def markdown_table(results: Sequence[CheckResult]) -> str:
    def md(cell: str) -> str:
        return " ".join(cell.split()).replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(md(c) for c in row_cells(r)) + " |" for r in results]
    return "\n".join(lines)


def markdown_report(
    results: Sequence[CheckResult], skipped: Sequence[RegistryEntry] = (), settings: CheckSettings = DEFAULT_SETTINGS
) -> str:
    details = "\n".join(details_markdown(r) for r in results)
    return (
        f"# workbench check\n\n**{summary_line(results, skipped)}**\n\n{settings_line(settings)}\n\n"
        f"{markdown_table(results)}\n\n## Entries\n\n{details}"
    )


def html_report(
    results: Sequence[CheckResult], skipped: Sequence[RegistryEntry] = (), settings: CheckSettings = DEFAULT_SETTINGS
) -> str:
    """A standalone page: the summary line and a plain table, every cell escaped."""
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
    rows = "\n".join(
        f'<tr class="{"pass" if r.passed else "fail"}">' + "".join(f"<td>{e(c)}</td>" for c in row_cells(r)) + "</tr>"
        for r in results
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>workbench check</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #bbb; padding: 0.3em 0.5em; text-align: left; vertical-align: top; }}
th {{ background: #eee; }}
tr.pass td:last-child {{ color: #17692a; }}
tr.fail td:last-child {{ color: #a61b1b; font-weight: bold; }}
details {{ margin: 0.4em 0; }}
details.fail > summary {{ color: #a61b1b; font-weight: bold; }}
</style></head>
<body>
<h1>workbench check</h1>
<p class="summary"><b>{e(summary_line(results, skipped))}</b></p>
<p>{e(settings_line(settings))}</p>
<table>
<thead><tr>{head}</tr></thead>
<tbody>
{rows}
</tbody>
</table>
<h2>Entries</h2>
{"".join(details_html(r) for r in results)}
</body></html>
"""


def write_reports(
    results: Sequence[CheckResult],
    out_dir: Union[str, Path],
    skipped: Sequence[RegistryEntry] = (),
    settings: CheckSettings = DEFAULT_SETTINGS,
) -> Tuple[Path, Path]:
    """Write ``out_dir/check_report.md`` and ``out_dir/check_report.html``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, html_path = out / "check_report.md", out / "check_report.html"
    md_path.write_text(markdown_report(results, skipped, settings))
    html_path.write_text(html_report(results, skipped, settings))
    return md_path, html_path


__all__ = ["COLUMNS", "html_report", "markdown_report", "markdown_table", "row_cells", "summary_line", "write_reports"]
