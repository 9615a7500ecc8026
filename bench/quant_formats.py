"""Per-format table of the quantized pipelines against their dequantized twins (issue 17).

    .venv/bin/python bench/quant_formats.py                    # all 8 cases, markdown table on stdout
    .venv/bin/python bench/quant_formats.py --cases fp8 nvfp4 --new-tokens 16

Each case writes a tiny quantized checkpoint with ``save_tiny_quantized`` into a temporary
directory (random ``tiny:<arch>`` weights, seed 0; nothing downloaded), loads it, and runs two
pipelines on CPU in fp32:

* the **quantized** pipeline: ``Workbench(loaded)``, the whole default pipeline; the quantize
  transforms put the canonical quantized ops in the graph and ``load_weights`` binds the raw
  quantized tensors;
* the **twin** pipeline: the same ``LoadedModel`` without its checkpoint (the dequantized fp32
  model, no quant config): the quantize transforms find nothing, ``load_weights`` binds fp32 weights.
  It only runs up to ``load_weights`` (its bytes are all that is read from it).

Columns:

* tokens: the quantized pipeline's greedy tokens (``wb.generate``, no stop token) against Hugging
  Face's greedy ``generate`` on the twin model -- the reference the end-to-end tests use. "first
  diff" is ``prompt:position`` of the first differing token. The tiny models are random, so their
  greedy continuations are often repetitive: the logit columns say more than the tokens do.
* rmse / top1: the final graph's probe numerics against the twin (relative logit RMSE, top-1
  agreement), as the last snapshot records them.
* graph bytes: what the ``load_weights`` snapshot's memory delta says each graph binds (quantized
  vs twin fp32, and their ratio; "bf16 twin" = fp32 / 2, what the twin would hold in bf16). The
  quantized graph keeps everything it does not quantize in fp32 (embeddings, norms, the tied LM
  head; the attention of MXFP4 MoE), which dominates at this tiny size: hence the next columns.
* quantized weights: the bytes of the tensors the quantize transforms bound from the checkpoint
  (weights + scales) against the same weights in bf16. The twin's share is its delta minus the
  tensors both graphs hold unchanged (checked: same name, same bytes), halved.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny_quantized import save_tiny_quantized
from workbench.pipeline.weights import tensor_attributes, tensor_bindings

# case -> (arch, checkpoint format, save_tiny_quantized options, quantized op to find in the final graph)
CASES: Dict[str, Tuple[str, str, dict, str]] = {
    "fp8": ("llama", "FP8", {}, "torch_fp8_linear"),
    "fp8_block": ("llama", "FP8_BLOCK", {"block": (32, 32)}, "torch_finegrained_fp8_swiglu_mlp"),
    "nvfp4": ("llama", "NVFP4", {}, "torch_nvfp4_swiglu_mlp"),
    "mxfp4_moe": ("qwen3_moe", "MXFP4", {}, "torch_mxfp4_moe"),
    "w4a16_awq": ("llama", "W4A16_AWQ", {}, "torch_int4_awq_linear"),
    "w4a16_gptq": ("llama", "W4A16_GPTQ", {"desc_act": True}, "torch_int4_gptq_linear"),
    "fp8_moe": ("qwen3_moe", "FP8", {}, "torch_fp8_moe"),
    "nvfp4_moe": ("qwen3_moe", "NVFP4", {}, "torch_nvfp4_moe"),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 300, 11], [42], [9, 8, 7, 6, 5, 4, 3, 2]]


def hf_greedy(model: torch.nn.Module, prompt: List[int], n: int) -> List[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_difference(a: List[List[int]], b: List[List[int]]) -> Optional[str]:
    """``prompt:position`` of the first token where ``a`` and ``b`` differ, None when equal."""
    for p, (x, y) in enumerate(zip(a, b)):
        for t, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return f"{p}:{t}"
        if len(x) != len(y):
            return f"{p}:{min(len(x), len(y))}"
    return None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (tied weights, views)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def weight_bytes(quantized_gm: torch.nn.Module, twin_gm: torch.nn.Module) -> Tuple[int, int]:
    """(bytes of the tensors bound from the checkpoint, fp32 bytes of the twin weights they replace).

    Every other tensor of the quantized graph must be in the twin graph under the same name with the
    same bytes; otherwise the split would be meaningless, so that is an error."""
    bound = tensor_bindings(quantized_gm)
    tensors, twin = tensor_attributes(quantized_gm), tensor_attributes(twin_gm)
    kept = {n: t for n, t in tensors.items() if n not in bound}
    for name, t in kept.items():
        if name not in twin or storage_bytes([twin[name]]) != storage_bytes([t]):
            raise ValueError(f"{name} is held unquantized by the quantized graph but differs in the twin graph; "
                             "the bytes cannot be split into quantized weights and the rest")
    quantized = storage_bytes(t for n, t in tensors.items() if n in bound)
    return quantized, storage_bytes(twin.values()) - storage_bytes(kept.values())


def run_case(name: str, new_tokens: int) -> dict:
    arch, fmt, options, _ = CASES[name]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"quant_{name}_") as tmp:  # kept while the pipelines run
        loaded = load_model(str(save_tiny_quantized(arch, fmt, tmp, **options)))
        return _compare(name, loaded, new_tokens, t0)


def _compare(name: str, loaded, new_tokens: int, t0: float) -> dict:
    arch, fmt, _, op = CASES[name]
    wb = Workbench(loaded)
    wb.run()
    final = wb.snapshots[-1]
    if not any(k.endswith(f"{op}.default") for k in final.op_histogram):
        raise RuntimeError(f"{name}: no {op} in the final graph: {sorted(final.op_histogram)}")
    tokens = wb.generate(PROMPTS, max_new_tokens=new_tokens, stop_token_ids=[]).token_ids
    twin_tokens = [hf_greedy(loaded.model, p, new_tokens) for p in PROMPTS]

    twin = Workbench(dataclasses.replace(loaded, checkpoint=None), numerics=False)
    twin.run_to("load_weights")
    q_snap, t_snap = wb.snapshot("load_weights"), twin.snapshot("load_weights")
    q_weights, t_weights = weight_bytes(q_snap.module, t_snap.module)
    diff = first_difference(tokens, twin_tokens)
    return {
        "case": name, "arch": arch, "format": fmt, "op": op,
        "tokens": "equal" if diff is None else "differ", "first diff": diff or "-",
        "rmse": final.numerics.rmse_ratio, "top1": final.numerics.top1_agreement,
        "graph": q_snap.mem_delta, "twin fp32": t_snap.mem_delta, "bf16 twin": t_snap.mem_delta / 2,
        "graph/twin": q_snap.mem_delta / t_snap.mem_delta,
        "qweights": q_weights, "qweights bf16": t_weights / 2, "qweights/bf16": q_weights / (t_weights / 2),
        "seconds": time.perf_counter() - t0,
    }


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def markdown(rows: List[dict]) -> str:
    head = ["format", "arch", "quantized op", "tokens", "first diff", "logit RMSE", "top-1",
            "graph KiB", "twin fp32 KiB", "graph / twin", "bf16 twin KiB", "quantized weights KiB",
            "same in bf16 KiB", "weights / bf16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["format"], r["arch"], f"`{r['op']}`", r["tokens"], r["first diff"], f"{r['rmse']:.2e}",
                 f"{r['top1']:.3f}", kib(r["graph"]), kib(r["twin fp32"]), f"{r['graph/twin']:.3f}",
                 kib(r["bf16 twin"]), kib(r["qweights"]), kib(r["qweights bf16"]), f"{r['qweights/bf16']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per prompt (4 prompts)")
    args = ap.parse_args()
    rows = []
    for name in args.cases:
        rows.append(run_case(name, args.new_tokens))
        print(f"{name}: {rows[-1]['seconds']:.1f} s", flush=True)
    print()
    print(f"torch {torch.__version__}, CPU fp32, {len(PROMPTS)} prompts x {args.new_tokens} greedy tokens; "
          "tokens vs HF greedy on the dequantized twin, logits vs the twin (final graph's probe)")
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
