"""What the last cell of a notebook prints: where and how the compiled model ran, its answer, its speed.

Shared by ``Workbench.answer`` and ``ShardedWorkbench.answer``: both have snapshots by key (a
sharded one shows rank 0's face) and ``generate``; they differ in where device facts live.
"""

from __future__ import annotations

from typing import Any, Optional

from .runtime.generate import text_prompt_ids


def backends_line(wb: Any, where: str) -> str:
    """``where`` (device, dtype, ranks), then the cached-attention and compile backends of the
    finished pipeline with the reason each was chosen (as their snapshots recorded it). On a CPU
    also which build of the C++ kernels runs ("C++ kernels, AVX2 build") or why none does."""
    parts = [where]
    if where.startswith("cpu"):
        from .ops import cpu_kernels

        parts.append(cpu_kernels.describe())
    if "linear_weight_layout" in wb.keys and wb.status("linear_weight_layout") == "done":
        summary = wb.snapshot("linear_weight_layout").info.details.get("summary")
        if summary:
            parts.append(f"linears: {summary}")
    for key, what in (("insert_cached_attention", "attention"), ("compile_model", "compile")):
        if key in wb.keys and wb.status(key) == "done":
            details = wb.snapshot(key).info.details
            if "backend" in details:
                parts.append(f"{what} {details['backend']} [{details.get('chosen', 'requested')}]")
            left = details.get("uncached_attention") or {}
            if left:  # said in the line a user reads, not only in the cache stage's row
                parts.append(
                    f"attention UNCACHED: {len(left)} layer(s) without a KV cache, every step re-runs the whole "
                    "sequence (insert_cached_attention says which and why)"
                )
    return "; ".join(parts)


def answer(
    wb: Any,
    prompt: Any,
    max_new_tokens: int,
    where: str,
    has_tokenizer: bool,
    vocab_size: int,
    runner: Optional[Any] = None,
    **kwargs: Any,
):
    """Generate one greedy answer on ``wb``'s compiled model and print three lines: what ran, the
    answer, tokens/s (and the CUDA-graph replays of ``runner`` when it captures graphs)."""
    if isinstance(prompt, str) and not has_tokenizer:
        prompt = text_prompt_ids(prompt, vocab_size)  # a tiny random model has no tokenizer
    out = wb.generate([prompt], max_new_tokens=max_new_tokens, **kwargs)
    print(f"ran: {backends_line(wb, where)}")
    result = out.results[0]
    print(f"answer: {result.text if result.text is not None else result.token_ids}")
    graphs = ""
    if runner is not None and hasattr(runner, "replays"):
        graphs = f"; CUDA-graph replays so far {runner.replays}, eager steps {runner.eager_steps}"
    print(
        f"{out.stats.generated_tokens} tokens, {out.stats.decode_tokens_per_s:.1f} tok/s decode, "
        f"{out.stats.tokens_per_s:.1f} tok/s overall{graphs}"
    )
    return out


__all__ = ["answer", "backends_line"]
