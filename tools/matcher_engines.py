"""Does ``torch._inductor.pattern_matcher`` serve the workbench's declarative patterns?

    python tools/matcher_engines.py

Registers the two RMSNorm patterns of ``match_rmsnorm_pattern`` with Inductor's
``register_replacement`` -- once traced by Inductor's own ``fwd_only`` (make_fx), once by the
workbench's export tracer -- applies them to tiny:llama's graph after the post-export cleanups and
prints the matches beside ``match_rmsnorm_pattern``'s. Measured on torch 2.13 and 2.11 (see
docs/architecture.md, "Why our own pattern matcher"): Inductor 0 and 0 (with ``fwd_only`` the
cast-aware pattern even collapses into a duplicate of the plain one and registering it fails with
"Duplicate pattern": make_fx drops no-op casts the export graph keeps), ours 5.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

from workbench import Workbench
from workbench.pipeline.matcher import export_graph_module

EPS = 1e-6  # tiny:llama's rms_norm_eps (the literal must match: no sentinel binding here)


def with_casts(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.float32)


def plain(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def replacement(x, w):
    return torch.ops.workbench.torch_rmsnorm.default(x, w, EPS)


def inductor_matches(wb: Workbench, trace) -> str:
    gm = wb.snapshot("cleanup_input_constraints").graph_copy.materialize()
    passes = PatternMatcherPass()
    try:
        for search in (with_casts, plain):
            register_replacement(search, replacement, [torch.randn(2, 3, 8), torch.randn(8)], trace, passes)
        return str(passes.apply(gm.graph))
    except Exception as e:  # noqa: BLE001 - the finding is the error
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    wb = Workbench("tiny:llama", numerics=False)
    wb.run_to("match_rmsnorm_pattern")
    ours = wb.snapshot("match_rmsnorm_pattern").info.num_matches
    export_trace = lambda fn, args, **_: export_graph_module(fn, args)  # noqa: E731
    print(f"torch {torch.__version__}: RMSNorm matches on tiny:llama -- workbench matcher {ours}; "
          f"inductor (fwd_only trace) {inductor_matches(wb, fwd_only)}; "
          f"inductor (export trace) {inductor_matches(wb, export_trace)}")


if __name__ == "__main__":
    main()
