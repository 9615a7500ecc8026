"""The peers ``bench/decode.py`` compares against: HF ``generate`` (eager, static cache + compile),
llama.cpp, and the random-weight model shapes used where the real weights cannot travel."""

from __future__ import annotations

import importlib.util
import time
from typing import List, Optional, Tuple

import torch
from transformers import LlamaConfig
from transformers.generation.streamers import BaseStreamer


def _smollm2_shape() -> LlamaConfig:
    """SmolLM2-135M's architecture (random weights)."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def _llama3_8b_shape() -> LlamaConfig:
    """Llama-3-8B's architecture (random weights)."""
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


SHAPES = {"smollm2": _smollm2_shape, "llama3-8b": _llama3_8b_shape}


class _TokenClock(BaseStreamer):
    """Timestamps every ``put`` of ``generate``: the first is the prompt, then one per new token."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: List[float] = []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_rate(model, prompts: List[List[int]], new: int, device: torch.device,
                   compile_mode: Optional[str] = None, repeats: int = 2) -> float:
    """Decode tokens/s of ``model.generate`` (greedy, ``new`` tokens, no stop token): tokens 2..new
    over the time between the first and the last new token (the first one ends the prefill)."""
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    original = model.forward
    if compile_mode is not None:
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(original, mode=compile_mode, dynamic=False)
    try:
        best = float("inf")
        for i in range(repeats + 1):  # the first run warms up (and compiles)
            clock = _TokenClock(device)
            with torch.no_grad():
                model.generate(ids, streamer=clock, **kw)
            if i:
                best = min(best, clock.times[-1] - clock.times[1])
    finally:
        model.forward = original
    return ids.shape[0] * (new - 1) / best


def llama_cpp_decode_rate(spec: str, loaded, prompts: List[List[int]], new: int,
                          device: torch.device) -> Tuple[Optional[float], str]:
    """Decode tokens/s of llama.cpp on the same GGUF file, or (None, why it was skipped)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "skipped: llama-cpp-python is not installed (optional: pip install llama-cpp-python)"
    if device.type != "cpu":
        return None, "skipped: the llama.cpp row is CPU only"
    if spec != "smollm2":
        return None, "skipped: needs the model's GGUF file (only smollm2 ships one)"
    if len(prompts) != 1:
        return None, "skipped: llama-cpp-python's Llama API decodes one sequence at a time"
    from llama_cpp import Llama

    from workbench.models import resolve_spec

    path = str(resolve_spec("smollm2").path)
    llm = Llama(model_path=path, n_ctx=len(prompts[0]) + new + 8, n_threads=torch.get_num_threads(),
                verbose=False)
    best = float("inf")
    for _ in range(3):
        llm.reset()
        stamps = []
        for i, _tok in enumerate(llm.generate(prompts[0], top_k=1, temp=0.0, reset=True)):
            stamps.append(time.perf_counter())
            if i + 1 == new:
                break
        best = min(best, stamps[-1] - stamps[0])
    return (new - 1) / best, f"GGUF {path.rsplit('/', 1)[-1]} (its own dtype, not fp32)"
