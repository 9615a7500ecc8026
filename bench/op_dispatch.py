"""Per-call cost of a ``workbench::`` op: ``custom_op`` vs ``define_op`` (a ``Library`` kernel) vs
calling the function, on a decode-sized RMSNorm ([1, 1, 576] fp32, one thread).

    .venv/bin/python bench/op_dispatch.py

Both registrations are made here under a scratch namespace with the same body
(``rmsnorm_reference``), so the difference is dispatch alone. µs per call, best of 3 x 5,000.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workbench.ops.normalization.torch_norms import _torch_rmsnorm_fake, rmsnorm_reference  # noqa: E402

SCHEMA = "rms(Tensor input, Tensor weight, float eps) -> Tensor"


def per_call_us(fn, n: int = 5000) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)

    @torch.library.custom_op("wbbench_custom::rms", mutates_args=())
    def rms_custom(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm_reference(input, weight, eps)

    rms_custom.register_fake(_torch_rmsnorm_fake)
    lib = torch.library.Library("wbbench_lib", "DEF")  # what define_op does, under a scratch name
    lib.define(SCHEMA)
    lib.impl("rms", rmsnorm_reference, "CompositeExplicitAutograd")

    x, w = torch.randn(1, 1, 576), torch.randn(576)
    with torch.no_grad():
        rows = {
            "custom_op": per_call_us(lambda: torch.ops.wbbench_custom.rms(x, w, 1e-5)),
            "define_op (Library)": per_call_us(lambda: torch.ops.wbbench_lib.rms(x, w, 1e-5)),
            "plain function": per_call_us(lambda: rmsnorm_reference(x, w, 1e-5)),
        }
    print(f"torch {torch.__version__}, 1 thread, rmsnorm on [1, 1, 576] fp32")
    for name, us in rows.items():
        print(f"{name:22s} {us:6.1f} us/call")
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
