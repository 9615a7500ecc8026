"""``generate``: prompts in, text and tokens/s out, with continuous batching over a runner.

Prompts may be strings (wrapped in the tokenizer's chat template when it has one), chat message
lists (``[{"role": "user", "content": ...}]``), or token-id lists (models without a tokenizer).
All prompts are submitted at once; the scheduler runs as many as fit (``max_batch_size``
sequences, the cache's pages) and starts the rest as others finish.

Bad input never takes the batch down: each prompt is validated on its own and a bad one gets a
result with ``finish_reason="error"`` and the reason, while the others run exactly as they would
alone. The rules, per prompt:

* empty prompt, or token ids outside the vocabulary -> error;
* more prompts than ``max_batch_size`` -> queued, run as slots free up (no error);
* prompt + ``max_new_tokens`` longer than one sequence may hold (``max_seq_len``, or the whole
  cache if smaller): ``max_new_tokens`` is reduced to what fits (noted in ``result.notes``,
  ``finish_reason="length"``); a prompt that leaves no room for even one new token is an error.
  With ``truncate_prompt=True`` the prompt keeps only its last ``capacity - max_new_tokens``
  tokens (at least one) instead, so all ``max_new_tokens`` fit (also noted).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import InputError
from .prompts import Prompts, admit, default_stop_token_ids, is_token_id
from .runner import Runner
from .sampling import SamplingParams, sample
from .scheduler import Request


@dataclass(frozen=True)
class TokenEvent:
    """What the streaming callback receives for every generated token."""

    index: int  # which prompt
    token_id: int
    text: str  # newly decoded text ("" without a tokenizer, or mid multi-byte character)
    finished: bool
    finish_reason: Optional[str] = None


@dataclass
class GenerationResult:
    index: int
    prompt_token_ids: List[int]
    token_ids: List[int]  # generated tokens (a stop token, if hit, is the last one)
    text: Optional[str]  # decoded generated text without special tokens; None without tokenizer
    finish_reason: str  # "stop" | "length" | "error"
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)


# The question every quick run asks (``workbench run``, ``Workbench.answer``): SmolLM2 answers
# "The capital of France is Paris."
DEFAULT_PROMPT = "What is the capital of France?"


def text_prompt_ids(prompt: str, vocab_size: int) -> List[int]:
    """Token ids for a model without a tokenizer (the ``tiny:`` configs): the prompt's UTF-8 bytes
    modulo the vocabulary, so the same prompt always gives the same ids. An empty prompt has no
    token to continue from: refused, as for a model with a tokenizer."""
    if not prompt:
        raise InputError("the prompt is empty: there is no token to continue from; give some text")
    return [b % vocab_size for b in prompt.encode("utf-8")]


@dataclass
class GenerationStats:
    num_prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    mixed_steps: int = 0  # steps with prefill and decode sequences together
    max_concurrency: int = 0  # most sequences in one step
    total_s: float = 0.0
    decode_s: float = 0.0  # time in decode-only steps
    decode_tokens: int = 0  # tokens produced by decode-only steps
    time_to_first_token_s: Optional[float] = None  # mean over prompts
    # generate(profile_steps=True): medians over decode-only steps, in ms (see StepProfiler)
    decode_step_ms: Optional[Dict[str, float]] = None
    # how the runner reaches earlier tokens: "paged KV cache", or "uncached (full re-forward)" when no cache
    # stage ran (every step re-runs each sequence's whole history)
    cache: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def __str__(self) -> str:
        ttft = f", ttft {self.time_to_first_token_s * 1e3:.0f} ms" if self.time_to_first_token_s else ""
        return (
            f"{self.generated_tokens} tokens for {self.num_prompts} prompt(s) in {self.total_s:.2f}s: "
            f"{self.tokens_per_s:.1f} tok/s overall, {self.decode_tokens_per_s:.1f} tok/s decode "
            f"({self.steps} steps, {self.mixed_steps} mixed, up to {self.max_concurrency} sequences{ttft}"
            + (f", {self.cache}" if self.cache else "")
            + ")"
            + (f"; decode step (median ms): {format_step_profile(self.decode_step_ms)}" if self.decode_step_ms else "")
        )


def format_step_profile(ms: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in ms.items())


class StepProfiler:
    """Where a decode step's time goes, measured around the runner call (``profile_steps=True``).

    ``schedule``: picking the step's sequences and pages; ``runner_host``: from calling the runner
    until it returns -- preparing inputs and launching the forward (on CPU also computing it);
    ``device_wait``: a synchronize right after (the device still finishing what was launched);
    ``gpu``: CUDA-event time of the runner call on the stream (a graph replay's device time);
    ``sample``: choosing the next tokens (and bringing them to the host); ``bookkeeping``: appending
    them, stop checks, freeing finished sequences, streaming. On a GPU the synchronize costs the overlap
    of host and device work, so profiled runs are a little slower than plain ones.
    """

    def __init__(self, device: Optional[torch.device]):
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.rows: List[Dict[str, float]] = []

    def runner_call(self, fn: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, float]]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if self.cuda:
            end.record()
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        row = {"runner_host": (t1 - t0) * 1e3, "device_wait": (t2 - t1) * 1e3}
        if self.cuda:
            row["gpu"] = start.elapsed_time(end)
        return out, row

    def medians(self) -> Optional[Dict[str, float]]:
        if not self.rows:
            return None
        keys = list(self.rows[0])
        return {k: float(statistics.median(r[k] for r in self.rows)) for k in keys}


@dataclass
class GenerationOutput:
    results: List[GenerationResult]
    stats: GenerationStats

    @property
    def texts(self) -> List[Optional[str]]:
        return [r.text for r in self.results]

    @property
    def text(self) -> Optional[str]:
        return self.results[0].text if self.results else None

    @property
    def token_ids(self) -> List[List[int]]:
        return [r.token_ids for r in self.results]

    def __str__(self) -> str:
        lines = []
        for r in self.results:
            body = r.text if r.text is not None else str(r.token_ids)
            lines.append(f"[{r.index}] ({r.finish_reason}) {body if r.error is None else 'error: ' + r.error}")
        return "\n".join(lines + [str(self.stats)])


# ------------------------------------------------------------------------------ the loop


def _results(requests: Sequence[Request], tokenizer: Any) -> List[GenerationResult]:
    return [
        GenerationResult(
            index=r.index,
            prompt_token_ids=list(r.prompt),
            token_ids=list(r.generated),
            text=_decode(tokenizer, r.generated) if r.error is None else None,
            finish_reason=r.finish_reason or "error",
            error=r.error,
            notes=list(r.notes),
        )
        for r in requests
    ]


def generate(
    runner: Runner,
    prompts: Prompts,
    *,
    tokenizer: Any = None,
    vocab_size: Optional[int] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    stop_token_ids: Optional[Iterable[int]] = None,
    chat_template: Optional[bool] = None,
    seed: int = 0,
    stream: Optional[Callable[[TokenEvent], None]] = None,
    truncate_prompt: bool = False,
    profile_steps: bool = False,
) -> GenerationOutput:
    """Generate for every prompt with continuous batching; see the module docstring for input rules.

    ``stop_token_ids`` None: the tokenizer's EOS; ``[]``: never stop early. ``stream`` is called
    for every generated token as it is produced. ``profile_steps``: split each decode step's time
    into host and device parts (``stats.decode_step_ms``, see ``StepProfiler``).
    """
    if not is_token_id(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    params = SamplingParams(temperature, top_k, top_p)
    if stop_token_ids is not None:
        given = stop_token_ids
        stop_token_ids = None if isinstance(given, (str, bytes)) else list(given)
        if stop_token_ids is None or not all(map(is_token_id, stop_token_ids)):
            raise InputError(f"stop_token_ids: expected a list of int token ids ([] never stops early), got {given!r}")
    stops = frozenset(stop_token_ids) if stop_token_ids is not None else default_stop_token_ids(tokenizer)
    sched = runner.scheduler()
    requests = admit(
        sched, prompts, tokenizer, chat_template, vocab_size, max_new_tokens, params, stops, truncate_prompt
    )

    stats = GenerationStats(
        num_prompts=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests), cache=runner.cache_mode
    )
    gen = torch.Generator().manual_seed(seed)
    texts: Dict[int, Any] = {}
    t0 = time.perf_counter()
    profiler = StepProfiler(runner.device) if profile_steps else None
    while sched.has_work:
        t_sched = time.perf_counter()
        step = sched.schedule()
        if not step.items:
            raise RuntimeError("scheduler made no progress (a waiting request can never fit); this is a bug")
        ts = time.perf_counter()
        if profiler is None:
            logits = runner.step(step, sched)  # [B, V]
        else:
            logits, timing = profiler.runner_call(functools.partial(runner.step, step, sched))
            t_sample = time.perf_counter()
        ready = []  # rows whose sequence now needs its next token
        for row, (req, n) in enumerate(step.items):
            req.num_cached += n
            if req.num_cached == len(req.tokens):
                ready.append((row, req))
        # a decode step reads every row: no gather, and greedy picks need no fp32 copy (sample converts)
        picked = logits if len(ready) == logits.shape[0] else logits[[r for r, _ in ready]]
        new_tokens = sample(picked, [q.sampling for _, q in ready], gen) if ready else []
        now = time.perf_counter()
        for (_, req), tok in zip(ready, new_tokens):
            req.tokens.append(tok)
            if req.first_token_s is None:
                req.first_token_s = now - t0
            if tok in req.stop_ids:
                sched.finish(req, "stop")
            elif len(req.generated) >= req.max_new_tokens:
                sched.finish(req, "length")
            if stream is not None:
                stream(TokenEvent(req.index, tok, _text_delta(req, tokenizer, texts), req.done, req.finish_reason))
        stats.steps += 1
        stats.mixed_steps += int(0 < step.num_prefill < len(step.items))
        stats.max_concurrency = max(stats.max_concurrency, len(step.items))
        if step.num_prefill == 0:
            stats.decode_s += now - ts
            stats.decode_tokens += len(new_tokens)
            if profiler is not None:
                done = time.perf_counter()
                profiler.rows.append(
                    {
                        "schedule": (ts - t_sched) * 1e3,
                        **timing,
                        "sample": (now - t_sample) * 1e3,
                        "bookkeeping": (done - now) * 1e3,
                        "total": (done - t_sched) * 1e3,
                    }
                )
    stats.total_s = time.perf_counter() - t0
    stats.decode_step_ms = profiler.medians() if profiler is not None else None
    stats.generated_tokens = sum(len(r.generated) for r in requests)
    firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
    stats.time_to_first_token_s = sum(firsts) / len(firsts) if firsts else None
    return GenerationOutput(_results(requests, tokenizer), stats)


def _decode(tokenizer: Any, ids: Sequence[int]) -> Optional[str]:
    if tokenizer is None:
        return None
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _text_delta(req: Request, tokenizer: Any, texts: dict) -> str:
    """Text added by the latest token (decoding the whole tail keeps multi-token characters right)."""
    if tokenizer is None:
        return ""
    full = _decode(tokenizer, req.generated) or ""
    prev = texts.get(req.index, "")
    if full.endswith("\ufffd"):
        return ""  # an incomplete UTF-8 sequence: wait for the next token
    texts[req.index] = full
    return full[len(prev) :] if full.startswith(prev) else full


__all__ = ["generate", "GenerationOutput", "GenerationResult", "GenerationStats", "TokenEvent"]
