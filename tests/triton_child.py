"""Triton kernels under ``TRITON_INTERPRET=1`` in a child process, for the op test files.

The interpreter must be switched on before triton is imported (and kernels decorated), so the checks
run in a child: the test file re-runs itself with ``--interpret`` and prints one JSON line of
``{case: "ok" | traceback}``; every case runs even when an earlier one fails.

In a test file::

    def _interpreter_checks():           # name -> zero-arg callable that raises on failure
        return {"schedule": lambda: ..., ...}

    interpreter_results = interpreter_results_fixture(__file__)

    @pytest.mark.parametrize("case", TRITON_CASES)
    def test_triton_interpreter(interpreter_results, case):
        assert interpreter_results[case] == "ok", interpreter_results[case]

    if __name__ == "__main__":
        child_main(_interpreter_checks)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Callable, Dict

import pytest

from workbench.ops.triton_support import HAS_TRITON, interpreter_numpy_clash

# Why Triton's interpreter cannot run here ('' when it can): triton missing, or triton < 3.7 with
# numpy >= 2.4 (the GPU image's pair; its compiled kernels on a GPU are not affected)
INTERPRETER_SKIP = (interpreter_numpy_clash() if HAS_TRITON else "triton is not installed")


def run_checks(checks: Dict[str, Callable[[], object]]) -> Dict[str, str]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the child with TRITON_INTERPRET=1"
    import torch

    results = {}
    for name, fn in checks.items():
        try:
            torch.manual_seed(0)  # each case sees the same random inputs on every run, in any order
            fn()
            results[name] = "ok"
        except Exception:  # report every case, not just the first failure
            results[name] = traceback.format_exc()
    return results


def child_main(checks: Callable[[], Dict[str, Callable[[], object]]]) -> None:
    """The child's entry point (``python <test file> --interpret``): one torch thread, one JSON line."""
    if "--interpret" not in sys.argv:
        return
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run_checks(checks())))


def interpreter_results_fixture(test_file: str, timeout: int = 300):
    """A module-scoped fixture running ``test_file --interpret`` once and returning its results."""

    @pytest.fixture(scope="module")
    def interpreter_results():
        if INTERPRETER_SKIP:
            pytest.skip(INTERPRETER_SKIP)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, test_file, "--interpret"], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=os.path.dirname(os.path.abspath(test_file)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return interpreter_results


def generate_with_triton_backend_equals_hf(arch: str, insert_key: str, triton_op: str, count: int,
                                           prompt_lens=(5, 13), new_tokens: int = 8, prepare=None) -> None:
    """``tiny:<arch>`` through the whole pipeline with ``<insert_key>.backend: triton``: the graph calls
    ``triton_op`` ``count`` times and greedy generation equals HF's tokens (``prepare(model)`` may
    re-draw weights first). Runs in the interpreter child."""
    import torch
    from test_runtime import _hf_greedy

    from workbench import Workbench
    from workbench.models import load_model

    loaded = load_model(f"tiny:{arch}")
    if prepare is not None:
        prepare(loaded.model)
    bench = Workbench(loaded, overrides={f"{insert_key}.backend": "triton"}, numerics=False)
    bench.run()
    hist = bench.snapshots[-1].op_histogram
    assert hist.get(f"workbench.{triton_op}.default", 0) == count, hist
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in prompt_lens]
    out = bench.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    for p, r in zip(prompts, out.results):
        assert r.token_ids == _hf_greedy(loaded.model, p, new_tokens), f"prompt of {len(p)} tokens"
