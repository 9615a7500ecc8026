"""Decode tokens/s of the plain runner on the finished graph vs on its lean copy (``runtime/lean_graph.py``).

    .venv/bin/python bench/lean_graph.py [--model smollm2] [--rounds 5] [--new-tokens 64] [--gguf-weights keep]

One process, one pipeline (default config, backend torch-simple): the same runner generates from
the same prompt with ``runner.fn`` set to the pipeline's graph, then to the lean copy, alternating
for ``--rounds`` rounds (so a drift of the machine hits both alike). Prints each measurement as it
is taken, the token check (both must give the same tokens) and the median ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench import Workbench  # noqa: E402
from workbench.runtime.lean_graph import rewritten_nodes  # noqa: E402
from workbench.runtime.runner import runner_for  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to write compilers."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gguf-weights", default="keep", choices=("keep", "dequantize"))
    args = ap.parse_args()
    wb = Workbench(args.model, numerics=False, gguf_weights=args.gguf_weights)
    wb.run()
    runner = wb._runner_for_generate(runner_for)
    graph, lean = wb.module, runner.fn
    print(f"{args.model}: {len(graph.graph.nodes)} nodes, {rewritten_nodes(graph)} called leaner", flush=True)
    speeds: dict = {"graph": [], "lean": []}
    tokens: dict = {}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        for name, fn in (("graph", graph), ("lean", lean)):
            runner.fn = fn
            out = wb.generate(PROMPT, max_new_tokens=args.new_tokens, stop_token_ids=[])
            tokens.setdefault(name, out.token_ids)
            if r:
                speeds[name].append(out.stats.decode_tokens_per_s)
                print(f"round {r} {name:5s} {out.stats.decode_tokens_per_s:7.1f} tok/s decode", flush=True)
    runner.fn = lean
    print(f"same tokens: {tokens['graph'] == tokens['lean']}")
    g, lean_s = median(speeds["graph"]), median(speeds["lean"])
    ratios = [b / a for a, b in zip(speeds["graph"], speeds["lean"])]
    print(f"median graph {g:.1f} tok/s, lean {lean_s:.1f} tok/s; lean/graph per round: "
          f"{', '.join(f'{x:.3f}' for x in ratios)} (median {median(ratios):.3f})")


if __name__ == "__main__":
    main()
