"""Export + greedy tokens per model, as JSON: run under two torch versions and diff the outputs.

    python tools/export_report.py tiny:llama smollm2 > report-$(python -c 'import torch; print(torch.__version__)').json

For each model: the torch/transformers versions, export_to_gm's trace device, export ranges and op
histogram (meta trace), the same histogram traced on the model's own device (must be equal), the
histograms after the pattern-matcher stage (the canonical graph) and at the end of the pipeline,
and the greedy tokens of the full default pipeline on a fixed prompt. The raw export histogram
follows the installed transformers' modeling code; the canonical one must not. Used to check that the graph
does not depend on the torch version (docs/benchmarks.md, "export across torch versions").
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import transformers

from workbench import Workbench
from workbench.models import list_tiny_archs, load_model

PROMPT = "What is the capital of France?"


def report(spec: str, new_tokens: int) -> dict:
    loaded = load_model(spec)
    out = {"spec": spec}
    wb = Workbench(loaded, numerics=False)
    t0 = time.perf_counter()
    snap = wb.step()
    out["export_s"] = round(time.perf_counter() - t0, 2)
    out["trace_device"] = snap.info.details["trace_device"]
    out["export_ranges"] = snap.info.details["export_ranges"]
    out["op_histogram"] = dict(sorted(snap.op_histogram.items()))
    on_model = Workbench(loaded, numerics=False, overrides=["export_to_gm.trace_device=model"])
    out["same_histogram_as_model_device_trace"] = on_model.step().op_histogram == snap.op_histogram
    if loaded.tokenizer is not None:
        prompt = PROMPT
    else:  # tiny models have no tokenizer: fixed token ids
        prompt = [[1, 7, 42, 99, 5, 3, 250, 11]]
    gen = wb.generate(prompt, max_new_tokens=new_tokens)
    last_pattern = [x for x in wb.snapshots if x.stage.value == "pattern_matcher"][-1]
    out["canonical_histogram"] = dict(sorted(last_pattern.op_histogram.items()))
    out["final_histogram"] = dict(sorted(wb.snapshots[-1].op_histogram.items()))
    out["greedy_tokens"] = gen.token_ids
    out["text"] = gen.text
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="*", help="models (default: every tiny arch and smollm2)")
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    specs = args.specs or [f"tiny:{a}" for a in list_tiny_archs()] + ["smollm2"]
    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "python": sys.version.split()[0], "models": [report(s, args.new_tokens) for s in specs]}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
