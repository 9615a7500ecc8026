"""Decode tokens/s of the plain runner stepping the finished graph three ways: the pipeline's graph
itself, its lean Python copy (``runtime/lean_graph.py``) and the C++ step program
(``runtime/step_program.py``, what the CPU runner uses).

    .venv/bin/python bench/lean_graph.py [--model smollm2] [--rounds 5] [--new-tokens 64] [--gguf-weights keep]

One process, one pipeline (default config, backend torch-simple): the same runner generates from
the same prompt with ``runner.fn`` set to each form in turn, alternating for ``--rounds`` rounds (so
a drift of the machine hits all alike). Prints each measurement as it is taken, the token check
(all must give the same tokens) and the median ratios to the graph.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench import Workbench  # noqa: E402
from workbench.runtime.lean_graph import lean_copy, rewritten_nodes  # noqa: E402
from workbench.runtime.runner_for import runner_for  # noqa: E402
from workbench.runtime.step_program import build  # noqa: E402

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
    graph = wb.module
    forms = {"graph": graph, "lean": lean_copy(graph)}
    program, why = build(graph)
    if program is None:
        print(f"no step program: {why}")
    else:
        forms["program"] = program
    print(f"{args.model}: {len(graph.graph.nodes)} nodes, {rewritten_nodes(graph)} called leaner in the lean copy, "
          f"{program.num_calls if program is not None else '-'} calls in the step program", flush=True)
    speeds: dict = {name: [] for name in forms}
    tokens: dict = {}
    before = runner.fn
    for r in range(args.rounds + 1):  # round 0 warms them up and is not counted
        for name, fn in forms.items():
            runner.fn = fn
            out = wb.generate(PROMPT, max_new_tokens=args.new_tokens, stop_token_ids=[])
            tokens.setdefault(name, out.token_ids)
            if r:
                speeds[name].append(out.stats.decode_tokens_per_s)
                print(f"round {r} {name:7s} {out.stats.decode_tokens_per_s:7.1f} tok/s decode", flush=True)
    runner.fn = before
    print(f"same tokens: {all(t == tokens['graph'] for t in tokens.values())}")
    for name in forms:
        ratios = [b / a for a, b in zip(speeds["graph"], speeds[name])]
        print(f"{name:7s} median {median(speeds[name]):6.1f} tok/s; /graph per round: "
              f"{', '.join(f'{x:.3f}' for x in ratios)} (median {median(ratios):.3f})")

if __name__ == "__main__":
    main()
