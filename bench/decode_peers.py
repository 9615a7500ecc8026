"""The peers ``bench/decode.py`` compares against: HF ``generate`` (eager; static cache with HF's own
compile), HF's model in a hand-written CUDA-graph decode loop, llama.cpp, and the random-weight model
shapes used where the real weights cannot travel.

An honest peer runs the way it really runs: the first version of this bench wrapped ``model.forward``
in ``torch.compile`` *and* asked ``generate`` for a static cache, so the prefill ran compiled, the
cache was allocated inside the compiled region (where HF cannot mark it static) and Inductor logged
"skipping cudagraphs due to mutated inputs" on an H100 -- that row ran without CUDA graphs. Now
``generate`` compiles its own decode step, and every compiled row counts Inductor's CUDA-graph skips
and says in its note whether graphs were captured.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path
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


def cudagraph_skips() -> int:
    """How often Inductor has refused CUDA graphs in this process so far (it logs "skipping
    cudagraphs due to ..." and counts each refusal here)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def hf_decode_rate(model, prompts: List[List[int]], new: int, device: torch.device,
                   compile_mode: Optional[str] = None, repeats: int = 2) -> Tuple[float, str]:
    """Decode tokens/s of ``model.generate`` (greedy, ``new`` tokens, no stop token): tokens 2..new
    over the time between the first and the last new token (the first one ends the prefill).

    ``compile_mode``: a static cache with HF's own compilation of the decode step
    (``CompileConfig(mode=...)``; the prefill stays eager, so the cache is allocated outside the
    compiled region and marked static, as CUDA graphs need). Returns (rate, note); the note says
    whether Inductor skipped CUDA graphs during these runs -- then the row ran compiled but
    without graphs, and says so.
    """
    from transformers import CompileConfig

    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    if compile_mode is not None:
        cc = CompileConfig(mode=compile_mode)
        cc._compile_all_devices = device.type != "cuda"  # HF compiles on accelerators only by default
        kw.update(cache_implementation="static", compile_config=cc)
    skips = cudagraph_skips()
    best = float("inf")
    for i in range(repeats + 1):  # the first run warms up (and compiles)
        clock = _TokenClock(device)
        with torch.no_grad():
            model.generate(ids, streamer=clock, **kw)
        if i:
            best = min(best, clock.times[-1] - clock.times[1])
    return ids.shape[0] * (new - 1) / best, _graph_note(compile_mode, device, cudagraph_skips() - skips)


def _graph_note(compile_mode: Optional[str], device: torch.device, skipped: int) -> str:
    if compile_mode != "reduce-overhead" or device.type != "cuda":
        return ""
    if skipped:
        return f"CUDA graphs SKIPPED by Inductor ({skipped}x): ran compiled, without graphs"
    return "CUDA graphs captured (no Inductor skip)"


def hf_graph_decode_rate(model, prompts: List[List[int]], new: int, device: torch.device,
                         compile_mode: str = "reduce-overhead", repeats: int = 2,
                         check_tokens: Optional[List[int]] = None) -> Tuple[float, str]:
    """The strongest HF configuration we know of: HF's model and ``StaticCache``, our own loop
    (no ``generate``): an eager prefill allocates the cache (HF marks its tensors as static
    addresses), then one ``torch.compile(mode=compile_mode, fullgraph=True)`` decode step per token,
    greedy. With ``reduce-overhead`` on CUDA each step replays a CUDA graph. ``check_tokens``: the
    first row's greedy tokens from ``generate``; a mismatch is reported in the note. Returns
    (rate, note)."""
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=device)
    b, p = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=p + new)

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # tok [B, 1], pos [1]
        out = model(input_ids=tok, position_ids=pos.expand(b, 1), past_key_values=cache, cache_position=pos,
                    use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    compiled = torch.compile(step, mode=compile_mode, fullgraph=True)
    skips = cudagraph_skips()
    best, tokens = float("inf"), []
    for i in range(repeats + 2):  # two warm-ups: compile, then CUDA-graph recording
        cache.reset()
        with torch.no_grad():
            pos = torch.arange(p, device=device)
            logits = model(input_ids=ids, position_ids=pos[None].expand(b, p), past_key_values=cache,
                           cache_position=pos, use_cache=True).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out = [tok]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for k in range(new - 1):
                tok = compiled(tok.clone(), torch.tensor([p + k], device=device))
                out.append(tok)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
        if i >= 2:
            best = min(best, elapsed)
        tokens = torch.cat(out, dim=1)[0].tolist()
    notes = [_graph_note(compile_mode, device, cudagraph_skips() - skips)]
    if check_tokens is not None:
        same = sum(a == b_ for a, b_ in zip(tokens, check_tokens))
        notes.append("tokens == HF generate" if tokens == check_tokens[: len(tokens)] else
                     f"tokens differ from HF generate ({same}/{len(tokens)} equal)")
    return b * (new - 1) / best, "; ".join(n for n in notes if n)


def hf_greedy_tokens(model, prompt: List[int], new: int, device: torch.device) -> List[int]:
    """Greedy tokens of eager ``generate`` for one prompt (the reference the graph loop is checked against)."""
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def llama_cpp_unavailable(spec: str, prompts: List[List[int]], device: torch.device) -> Optional[str]:
    """Why the llama.cpp rows cannot run here (None: they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "skipped: llama-cpp-python is not installed (optional: pip install -e '.[llamacpp]')"
    if device.type != "cpu":
        return "skipped: the llama.cpp row is CPU only"
    if spec != "smollm2":
        return "skipped: needs the model's GGUF file (only smollm2 ships one)"
    if len(prompts) != 1:
        return "skipped: llama-cpp-python's Llama API decodes one sequence at a time"
    return None


def llama_cpp_decode_rate(path: Path, prompts: List[List[int]], new: int, repeats: int = 3) -> float:
    """Decode tokens/s of llama.cpp on a GGUF file: greedy, ``new`` tokens after the prompt, tokens
    2..new over the time between the first and the last (best of ``repeats``)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompts[0]) + new + 8, n_threads=torch.get_num_threads(),
                verbose=False)
    best = float("inf")
    for _ in range(repeats):
        llm.reset()
        stamps = []
        for i, _tok in enumerate(llm.generate(prompts[0], top_k=1, temp=0.0, reset=True)):
            stamps.append(time.perf_counter())
            if i + 1 == new:
                break
        best = min(best, stamps[-1] - stamps[0])
    return (new - 1) / best


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of all tensors in a GGUF file (what llama.cpp reads per decode step, embedding tied)."""
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(str(path)).tensors))


def float32_gguf(src: Path) -> Path:
    """An F32 copy of the GGUF file ``src`` (metadata as is, every tensor dequantized): the same
    weights the workbench's fp32 model holds, so llama.cpp can be compared dtype for dtype.
    Written once next to the model loader's converted copy (``$WORKBENCH_CACHE_DIR``)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    from workbench.models.factory import converted_cache_dir

    cache = converted_cache_dir(src)
    dst = (cache.parent if cache else Path(tempfile.gettempdir())) / f"{src.stem}.F32.gguf"
    if dst.exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(src))
    tmp = dst.with_suffix(".partial")
    writer = GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer adds the GGUF.* header fields and the architecture itself
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = t.data if t.tensor_type == GGMLQuantizationType.F32 else dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)  # a killed run leaves no half-written file under the final name
    return dst
