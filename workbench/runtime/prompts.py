"""Prompts in, scheduled requests out: what ``generate`` accepts and how it admits each prompt.

A prompt is text, a chat message list (through the tokenizer's chat template), token ids, or a
``[batch, tokens]`` tensor of them (``Prompts``). Each becomes a ``Request``; a prompt that cannot
run (empty, ids outside the vocabulary, too long without ``truncate_prompt``) keeps its error and
the others still run; only when every prompt fails is the call itself an ``InputError``.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from ..errors import InputError
from .sampling import SamplingParams
from .scheduler import Request, Scheduler

PROMPTS_HELP = "a string, a chat message list, a list of token ids, a [batch, tokens] tensor, or a list of them"
#: One prompt: text, a chat message list, or token ids (a list or a 1-D tensor).
Prompt = Union[str, Sequence[Mapping[str, Any]], Sequence[int], torch.Tensor]
#: What ``generate`` takes: one prompt or a list of them (a 2-D tensor: one per row). Checked at run
#: time (``as_prompt_list``): a wrong type is an ``InputError`` naming ``PROMPTS_HELP``.
Prompts = Union[Prompt, Sequence[Prompt]]


def is_token_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def as_prompt_list(prompts: Any) -> List[Any]:
    """One prompt (a string, a message list, token ids) or a list of them -> a list of prompts.
    A 2-D tensor is one prompt per row. Anything else (None, a number, no prompt at all) is an
    ``InputError``: the call itself is wrong, unlike one bad prompt among several (see ``generate``)."""
    if isinstance(prompts, torch.Tensor):
        return list(prompts) if prompts.dim() == 2 else [prompts]
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, numbers.Number, dict)):
        raise InputError(f"prompts: expected {PROMPTS_HELP}; got {type(prompts).__name__} {prompts!r}"[:300])
    prompts = list(prompts)
    if not prompts:
        raise InputError(f"prompts: the list is empty; give {PROMPTS_HELP}")
    if all(isinstance(p, dict) for p in prompts):
        return [prompts]  # one conversation
    if all(isinstance(p, numbers.Number) for p in prompts):
        return [prompts]  # one prompt of token ids (non-integer ids are refused by encode_prompt)
    return prompts


def encode_prompt(prompt: Any, tokenizer: Any, chat_template: Optional[bool]) -> List[int]:
    """Token ids of one prompt; ``chat_template`` None means: use it when the tokenizer has one."""
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a {str(prompt.dtype).replace('torch.', '')} tensor")
        prompt = prompt.flatten().tolist()
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Number) for t in prompt):
        wrong = next((t for t in prompt if not is_token_id(t)), None)
        if wrong is not None:
            raise ValueError(f"token ids must be ints, got {type(wrong).__name__} {wrong!r} in {list(prompt)[:8]}")
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer (a random tiny: model): pass prompts as token-id lists such as "
            "[1, 2, 3], or use Workbench.answer(text), which turns text into UTF-8 byte ids"
        )
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str):
        if chat_template is False or (chat_template is None and not has_template) or not prompt:
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"]) if prompt else []
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        if not has_template:
            raise ValueError("chat messages given but the tokenizer has no chat template")
        enc = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(enc["input_ids"])
    raise ValueError(f"cannot use {type(prompt).__name__} as a prompt (str, chat messages or token ids)")


def default_stop_token_ids(tokenizer: Any = None, generation_config: Any = None) -> frozenset:
    """The model's end-of-sequence ids (tokenizer and generation config), as HF generate uses."""
    ids = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, Iterable):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _fit(req: Request, capacity: int, truncate_prompt: bool) -> None:
    """Apply the length rules of the module docstring (raises ValueError for an error)."""
    if req.reserve_tokens <= capacity:
        return
    if truncate_prompt and len(req.prompt) + req.max_new_tokens > capacity:
        keep = max(1, capacity - req.max_new_tokens)
        if keep < len(req.prompt):
            req.notes.append(
                f"prompt truncated from {len(req.prompt)} to its last {keep} tokens (cache holds {capacity})"
            )
            req.prompt = req.prompt[-keep:]
            req.tokens = list(req.prompt)
    if len(req.prompt) >= capacity:
        raise ValueError(
            f"prompt of {len(req.prompt)} tokens leaves no room for a new token: one sequence holds {capacity} "
            "tokens (raise max_seq_len / the cache size, or pass truncate_prompt=True)"
        )
    if req.reserve_tokens > capacity:
        new = capacity - len(req.prompt)
        req.notes.append(
            f"max_new_tokens reduced from {req.max_new_tokens} to {new} (one sequence holds {capacity} tokens)"
        )
        req.max_new_tokens = new


def admit(
    sched: Scheduler,
    prompts: Prompts,
    tokenizer: Any,
    chat_template: Optional[bool],
    vocab_size: Optional[int],
    max_new_tokens: int,
    params: SamplingParams,
    stops: frozenset,
    truncate_prompt: bool,
) -> List[Request]:
    """One ``Request`` per prompt, added to ``sched``; a prompt that cannot run keeps its error
    (``finish_reason`` "error") and the others still run. All failing is an ``InputError``."""
    capacity = sched.capacity()
    requests: List[Request] = []
    for i, p in enumerate(as_prompt_list(prompts)):
        req = Request(index=i, prompt=[], max_new_tokens=max_new_tokens, sampling=params, stop_ids=stops)
        requests.append(req)
        try:
            req.prompt = encode_prompt(p, tokenizer, chat_template)
            req.tokens = list(req.prompt)
            if not req.prompt:
                raise ValueError("empty prompt: there is no token to continue from")
            bad = [t for t in req.prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size})")
            _fit(req, capacity, truncate_prompt)
            sched.add(req)
        except ValueError as e:
            req.finish_reason, req.error = "error", str(e)
    if all(r.error for r in requests):  # nothing to generate: the call is wrong, say it instead of returning no tokens
        raise InputError("; ".join(f"prompt {r.index}: {r.error}" for r in requests)[:2000])
    return requests


__all__ = [
    "Prompt",
    "Prompts",
    "PROMPTS_HELP",
    "admit",
    "as_prompt_list",
    "encode_prompt",
    "default_stop_token_ids",
    "is_token_id",
]
