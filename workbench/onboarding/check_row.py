"""One ``workbench check`` row, the part both ways of running an entry share: how it is exercised
(``CheckSettings``), what it found (``CheckResult``), the prompts and HF's greedy reference tokens, and
the measures that fill the row from a pipeline's snapshots and ``generate``'s output.

``check.py`` runs an entry in one process and ``check_sharded.py`` on ``world_size`` ranks; both import
these from here (neither imports the other's names), and ``check.py`` re-exports them under their old
names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .divergence import first_difference
from .entry_details import StageResult, samples, stage_results

# insert transform key -> what it caches, in table order
CACHE_KINDS: Dict[str, str] = {
    "insert_cached_attention": "paged KV",
    "insert_cached_mla_attention": "paged MLA latent",
    "insert_cached_ssm_attention": "SSM state",
    "insert_cached_causal_conv": "conv state",
    "insert_cached_delta_rule": "delta-rule state",
    "insert_cached_gated_delta_rule": "gated delta-rule state",
    "insert_cached_linear_attention": "linear-attention state",
    "initialize_mrope_delta_cache": "mRoPE delta",
}
UNCACHED_RUNNER = "uncached"  # generate's stats.cache starts with it when no cache stage ran


@dataclass(frozen=True)
class CheckSettings:
    """How every entry is exercised: ``new_tokens`` greedy tokens (fp32) for prompts of ``prompt_lens``
    random token ids (seeded: the same prompts on every run), ``max_batch_size`` sequences at a time."""

    new_tokens: int = 16
    prompt_lens: Tuple[int, ...] = (5, 11, 3, 17)
    max_batch_size: int = 2
    prompt_seed: int = 3
    # the fewest distinct tokens HF's greedy continuation of every prompt must hold (of new_tokens)
    min_oracle_tokens: int = 8


@dataclass
class CheckResult:
    """One row of the report. ``stopped_at`` is empty when the pipeline reached its end, else where the
    check stopped: ``load``, ``config``, ``<stage>/<transform>``, ``hf reference`` or ``generate``."""

    key: str
    model: str
    family: str = "-"
    stopped_at: str = ""
    error: str = ""  # first line of what stopped it
    transforms_run: int = 0
    transforms_total: int = 0
    skipped_on_error: List[str] = field(default_factory=list)  # transforms with skip_on_error that failed
    cache_kinds: List[str] = field(default_factory=list)  # CACHE_KINDS values with matches > 0
    uncached_attention: Dict[str, str] = field(default_factory=dict)  # node -> why it has no cache
    runner_cache: str = ""  # generate's stats.cache
    tokens_equal: Optional[bool] = None  # None: not compared (the check stopped before)
    tokens: str = ""  # "yes" / "no: <first difference>"
    divergence: str = ""  # whose difference it is, when tokens differ (divergence.Divergence.line)
    oracle_tokens: Optional[int] = None  # fewest distinct tokens in HF's continuation of any prompt
    min_oracle_tokens: int = CheckSettings.min_oracle_tokens  # below it the oracle is weak (the row fails)
    worst_rmse: Optional[float] = None
    worst_rmse_at: str = ""
    probe_errors: int = 0
    seconds: float = 0.0
    memory: str = ""  # the estimate made before loading (memory_estimate.memory_refusal)
    stages: List[StageResult] = field(default_factory=list)  # the pipeline per stage (entry_details)
    samples: List[Tuple[str, str, str]] = field(default_factory=list)  # (prompt, output, HF output)

    @property
    def failure(self) -> str:
        """Why the entry does not pass, in a few words ("" when it passes)."""
        if self.stopped_at == "load":
            return "the model did not load"
        if self.stopped_at == "memory":
            return "does not fit in memory"
        if self.stopped_at == "config":
            return "invalid pipeline config"
        if self.stopped_at in ("hf reference", "generate"):
            return f"{self.stopped_at} failed"
        if self.stopped_at:
            return f"pipeline stopped at {self.stopped_at}"
        if self.uncached_attention:
            return f"{len(self.uncached_attention)} attention node(s) left uncached"
        if self.runner_cache.startswith(UNCACHED_RUNNER):
            return "generation ran uncached"
        if self.tokens_equal is not True:
            return "tokens differ from HF" + (f": {self.divergence}" if self.divergence else "")
        if self.weak_oracle:
            return (
                f"weak oracle: HF's greedy tokens for a prompt hold only {self.oracle_tokens} distinct tokens "
                f"(at least {self.min_oracle_tokens} needed to tell a broken cache from a working one)"
            )
        return ""

    @property
    def weak_oracle(self) -> bool:
        """HF's greedy tokens were counted and are too few distinct ones to prove anything."""
        return self.oracle_tokens is not None and self.oracle_tokens < self.min_oracle_tokens

    @property
    def passed(self) -> bool:
        return not self.failure


# ---------------------------------------------------------------------------------------------- pieces
def check_prompts(vocab_size: int, lens: Sequence[int] = CheckSettings.prompt_lens, seed: int = 3) -> List[List[int]]:
    """Seeded random token-id prompts of the given lengths (ids, not text: no chat template or tokenizer
    stands between the two sides of the comparison)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model: torch.nn.Module, prompt: List[int], new_tokens: int) -> List[int]:
    """HF ``generate``'s greedy continuation of one prompt, alone (no padding), never stopping early."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(  # type: ignore[operator]  # nn.Module's __getattr__ stub: an HF model's method
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def oracle_strength(want: Sequence[Sequence[int]]) -> Optional[int]:
    """The fewest distinct tokens among HF's continuations of the prompts (None: no prompts)."""
    return min((len(set(w)) for w in want), default=None)


def compare_tokens(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> Tuple[bool, str]:
    """(all equal, "yes" or "no: <the first prompt and position that differ>")."""
    equal = [list(g) == list(w) for g, w in zip(got, want)]
    first = first_difference(got, want)
    if first is None and len(got) == len(want):
        return True, "yes"
    i, pos = first if first is not None else (len(equal), 0)  # else: a prompt without an answer
    g, w = (list(got[i]), list(want[i])) if i < min(len(got), len(want)) else ([], [])
    at = (
        f"token {pos}: {g[pos]} vs HF {w[pos]}"
        if pos < min(len(g), len(w))
        else f"token {pos}: {len(g)} tokens vs HF {len(w)}"
    )
    return False, f"no: prompt {i + 1} of {len(want)} differs at new {at} ({sum(equal)} of {len(want)} equal)"


def inserted_cache_kinds(snapshots: Iterable) -> List[str]:
    """The cache kinds whose insert transform ran and matched, in ``CACHE_KINDS`` order."""
    done = {s.key for s in snapshots if s.status == "done" and s.info.num_matches > 0}
    return [what for key, what in CACHE_KINDS.items() if key in done]


def uncached_attention_left(snapshots: Iterable) -> Dict[str, str]:
    """Attention nodes ``insert_cached_attention`` reported as left without a KV cache: name -> why."""
    for s in snapshots:
        if s.key == "insert_cached_attention":
            return dict(s.info.details.get("uncached_attention") or {})
    return {}


def worst_probe(snapshots: Iterable) -> Tuple[Optional[float], str, int]:
    """(worst numerics-probe RMSE ratio, the transform it was measured after, probes that could not run)."""
    worst, at, errors = None, "", 0
    for s in snapshots:
        n = s.numerics
        if n is None:
            continue
        if not n.ok:
            errors += 1
        elif worst is None or n.rmse_ratio > worst:
            worst, at = n.rmse_ratio, s.key
    return worst, at, errors


def first_line(e: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <the first line of its message>"``, cut to ``limit`` characters (a row's error
    cell)."""
    text = str(e).strip()
    line = f"{type(e).__name__}: {text.splitlines()[0] if text else '(no message)'}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def record_pipeline(
    result: CheckResult, snapshots: Iterable, stages_of_entries: Sequence[str], total: Optional[int] = None
) -> None:
    """The row's pipeline fields from the snapshots of the steps that ran (``stages_of_entries``: the
    stage of every pipeline entry, in order; ``total``: the number of entries, if not all listed)."""
    snaps = list(snapshots)
    result.transforms_total = len(stages_of_entries) if total is None else total
    result.transforms_run = len(snaps)
    result.skipped_on_error = [s.key for s in snaps if s.status == "failed"]
    result.cache_kinds = inserted_cache_kinds(snaps)
    result.uncached_attention = uncached_attention_left(snaps)
    result.worst_rmse, result.worst_rmse_at, result.probe_errors = worst_probe(snaps)
    result.stages = stage_results(stages_of_entries, snaps)


def record_generation(result: CheckResult, out, prompts, want, tokenizer) -> None:
    """The row's generation fields from ``generate``'s output ``out`` against HF's tokens ``want``."""
    result.runner_cache = out.stats.cache
    failed = [r for r in out.results if r.error is not None]
    if failed:
        result.stopped_at = "generate"
        result.error = f"prompt {failed[0].index + 1}: {failed[0].error}".splitlines()[0][:300]
        return
    got = [r.token_ids for r in out.results]
    result.tokens_equal, result.tokens = compare_tokens(got, want)
    result.samples = samples(prompts, got, want, tokenizer)


def load_entry(entry, result: "CheckResult"):
    """The entry's model in float32 for the row, with ``result.family`` set; None (and the row
    stopped at "load" with the first line of why) when it does not load."""
    from ..models import load_model

    try:
        loaded = load_model(
            entry.name, dtype="float32", gguf_weights=entry.gguf_weights, custom_models=entry.custom_models
        )
    except Exception as e:  # noqa: BLE001  (any load failure is the row's result)
        result.stopped_at, result.error = "load", first_line(e)
        return None
    result.family = getattr(loaded.config, "model_type", None) or "-"
    return loaded


# ------------------------------------------------------ the steps the one-process and sharded checks share
def reference_tokens(
    hf_model: torch.nn.Module, prompts: Sequence[List[int]], settings: CheckSettings, result: CheckResult
) -> Optional[List[List[int]]]:
    """HF's greedy tokens for every prompt, each prompt alone (the row's reference), with the oracle's
    strength recorded; None, and the row stopped at "hf reference", when HF itself fails."""
    try:
        with torch.no_grad():
            want = [hf_greedy(hf_model, p, settings.new_tokens) for p in prompts]
    except Exception as e:  # noqa: BLE001
        result.stopped_at, result.error = "hf reference", first_line(e)
        return None
    result.oracle_tokens = oracle_strength(want)
    return want


def generate_and_record(wb, prompts, want, tokenizer, settings: CheckSettings, result: CheckResult):
    """The pipeline's cached greedy generation of ``prompts`` (one continuous batch), compared with HF's
    tokens ``want`` into the row; ``generate``'s output, or None (the row stopped at "generate") when
    it raised. ``wb`` is a ``Workbench`` or a ``ShardedWorkbench``: both ``generate`` alike."""
    try:
        out = wb.generate(prompts, max_new_tokens=settings.new_tokens, stop_token_ids=[])
    except Exception as e:  # noqa: BLE001
        result.stopped_at, result.error = "generate", first_line(e)
        return None
    record_generation(result, out, prompts, want, tokenizer)
    return out


__all__ = [
    "reference_tokens",
    "generate_and_record",
    "CACHE_KINDS",
    "UNCACHED_RUNNER",
    "CheckResult",
    "CheckSettings",
    "check_prompts",
    "compare_tokens",
    "first_line",
    "hf_greedy",
    "inserted_cache_kinds",
    "load_entry",
    "oracle_strength",
    "record_generation",
    "record_pipeline",
    "uncached_attention_left",
    "worst_probe",
]
