"""Greedy tokens of SmolLM2's Q4_1 paths against the fp32 model, and the logit margin where they part.

    .venv/bin/python bench/q4_tokens.py [--new-tokens 32]

The three paths run the same default pipeline: fp32 (the GGUF dequantized), Q4_1 kept 4-bit with
exact fp32 activations, and Q4_1 with activations rounded to 8 bits per block of 32
(``linear_weight_layout.int4_activations: int8``, llama.cpp's Q4_1 x Q8_1 arithmetic); the default,
``auto``, is one of the two, whichever this CPU's calibration picked (the run's summary says which). Where a Q4
path's tokens part from fp32's, the fp32 HF model is run on the prompt plus fp32's tokens up to that
point and prints its top-2 logit margin there: a parting at a near-tie of the fp32 model itself is
rounding, not a broken kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench import Workbench, load_model  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],  # the README prompt
    [{"role": "user", "content": "Write a haiku about compilers."}],
    [{"role": "user", "content": "List three prime numbers."}],
]


def greedy(loaded, activations: str, new: int):
    wb = Workbench(loaded, numerics=False, overrides={
        "initialize_cache.max_batch_size": len(PROMPTS), "initialize_cache.max_seq_len": 64 + new,
        "linear_weight_layout.int4_activations": activations})
    wb.run()
    return wb.generate(PROMPTS, max_new_tokens=new).token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    fp, q4 = load_model("smollm2", gguf_weights="dequantize"), load_model("smollm2")
    ref = greedy(fp, "fp32", args.new_tokens)
    tok, model = fp.tokenizer, fp.model.eval()
    for label, act in (("Q4_1, exact activations", "fp32"), ("Q4_1, int8 activations", "int8")):
        got = greedy(q4, act, args.new_tokens)
        for i, (a, b) in enumerate(zip(ref, got)):
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is None:
                print(f"{label}, prompt {i}: {len(a)} tokens equal to fp32")
                continue
            ids = tok.apply_chat_template(PROMPTS[i], add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids) + a[:first]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            print(f"{label}, prompt {i}: parts at token {first}: fp32 {tok.decode([a[first]])!r} "
                  f"({float(logits[a[first]]):.3f}) vs {tok.decode([b[first]])!r} ({float(logits[b[first]]):.3f}); "
                  f"fp32 top-2 margin {float(top[0] - top[1]):.3f}, logit std {float(logits.std()):.2f}")
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
