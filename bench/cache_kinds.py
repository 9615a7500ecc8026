"""Which cache kinds each family gets, what its state costs, and whether cached generation equals HF.

For every family (``tiny:<arch>``, seeded random weights of the family's own config class; the prompts,
HF reference and comparison are ``workbench check``'s, from ``workbench.onboarding.check``): the whole
default pipeline, then greedy generation of prompts of different lengths in one continuous batch
(prefill + decode steps mixed), compared token for token with HF ``generate`` on the same weights,
each prompt alone. Prints a Markdown table:

    family | cache kinds inserted | paged bytes/token | state bytes/sequence | tokens equal HF | probe | s

``paged bytes/token``: K/V (or MLA latent) pages, all layers; ``state bytes/sequence``: the SLOT
states (SSM, conv, delta rule, mRoPE delta), all layers, whatever the sequence length.

    .venv/bin/python bench/cache_kinds.py [--archs lfm2,mamba2,...] [--new 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import list_tiny_archs
from workbench.models.tiny_families.ssm import checkpoint_like_ssm_weights
from workbench.onboarding import load_registry
from workbench.onboarding.check import check_prompts, compare_tokens, hf_greedy, inserted_cache_kinds, worst_probe

DEFAULT_ARCHS = ["llama", "deepseek_v2", "deepseek_v2_q_lora", "mamba2", "bamba", "nemotron_h", "falcon_h1", "lfm2",
                 "qwen3_next", "deltanet", "qwen2_5_vl"]


def family_row(arch: str, new_tokens: int, lens=(5, 11, 3, 17)) -> Dict[str, object]:
    t0 = time.perf_counter()
    loaded = load_model(f"tiny:{arch}")
    # HF's random init leaves a Mamba-2 mixer's state below fp32 resolution in its output: re-draw those
    # mixers like a trained checkpoint so the state (and a cache that lost it) shows in the tokens
    checkpoint_like_ssm_weights(loaded.model, seed=1)
    # the pipeline YAML a family needs is the one its model-registry entry lists (e.g. qwen2_5_vl's mRoPE delta)
    extra = next((e.yaml_extra for e in load_registry().entries if e.name == f"tiny:{arch}"), [])
    # 4 prompts, 2 sequences at a time: later prompts reuse finished sequences' slots and pages
    wb = Workbench(loaded, yaml_extra=extra, max_batch_size=2)
    wb.run()
    kinds = inserted_cache_kinds(wb.snapshots)
    cfg = wb.ctx.cache.config
    prompts = check_prompts(wb.ctx.vocab_size, lens, seed=3)
    out = wb.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    _, equal = compare_tokens([r.token_ids for r in out.results], [hf_greedy(loaded.model, p, new_tokens) for p in prompts])
    worst, _, _ = worst_probe(wb.snapshots)
    return {
        "family": arch, "kinds": ", ".join(kinds) or "none",
        "paged_bytes_per_token": cfg.bytes_per_token() if cfg else 0,
        "state_bytes_per_seq": cfg.state_bytes_per_seq() if cfg else 0,
        "equal": equal, "cache": out.stats.cache, "probe": worst, "s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default=",".join(DEFAULT_ARCHS))
    ap.add_argument("--new", type=int, default=16, help="new tokens per prompt")
    args = ap.parse_args(argv)
    known = set(list_tiny_archs())
    archs = [a for a in args.archs.split(",") if a]
    missing = [a for a in archs if a not in known]
    if missing:
        print(f"not registered (skipped): {missing}", file=sys.stderr)
    print("| family | cache kinds inserted | paged bytes/token | state bytes/sequence | tokens equal HF "
          "(4 prompts, 2 at a time) | runner | worst probe RMSE ratio | s |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for arch in archs:
        if arch not in known:
            continue
        try:
            r = family_row(arch, args.new)
        except Exception as e:  # one family's failure is a row, not the end of the table
            failed += 1
            print(f"| {arch} | error: {type(e).__name__}: {str(e)[:160]} | | | no | | | |")
            continue
        probe = f"{r['probe']:.1e}" if r["probe"] is not None else "-"
        print(f"| {r['family']} | {r['kinds']} | {r['paged_bytes_per_token']} | {r['state_bytes_per_seq']} | "
              f"{r['equal']} | {r['cache']} | {probe} | {r['s']:.1f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
