"""Greedy generation on every ``tiny:`` arch equals ``transformers.generate``, token for token, with
every attention layer cached (MLA families: the latent cache) and the runner using its caches.

8 prompts of different lengths (1..47 tokens) run together with continuous batching, 32 new
tokens each; the reference generates each prompt alone. Per arch the pipeline runs with the
numerics probe on, and the cached decode is compared with a full re-forward step by step.

Backends: ``torch`` in-process; ``triton`` in a child process under ``TRITON_INTERPRET=1``
(the interpreter costs ~25 s per arch, so on CPU tiny:llama runs by default and the whole sweep
with ``WORKBENCH_TRITON_E2E=all``); on a GPU both run compiled, in-process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from triton_child import INTERPRETER_SKIP

from test_runtime import _hf_greedy, decode_vs_reforward

from workbench import Workbench
from workbench.models import load_model
from workbench.models.tiny import list_tiny_archs
from workbench.onboarding.check import UNCACHED_RUNNER, uncached_attention_left

ARCHS = list_tiny_archs()
#: The multi-head latent attention families: their cache must be the latent one (one torch_cached_mla per
#: layer), not per-head K/V -- both give HF's tokens, so only this tells them apart.
MLA_ARCHS = {"deepseek_v2", "deepseek_v2_q_lora", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "longcat_flash"}
LENS = [1, 3, 6, 9, 14, 22, 31, 47]
NEW = 32


GPU = torch.cuda.is_available()


ONE_THREAD = True  # see conftest.one_thread


def prompts_for(vocab: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]


def compare_with_hf(arch: str, backend: str, device: str = "cpu") -> dict:
    """Run the pipeline with ``backend``, generate, compare with HF; a JSON-able summary."""
    loaded = load_model(f"tiny:{arch}", device=device, dtype="float32")  # exact HF tokens: fp32
    bench = Workbench(loaded, device=device, overrides={"insert_cached_attention.backend": backend})
    bench.run()
    prompts = prompts_for(bench.ctx.vocab_size)
    out = bench.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    mismatches = {}
    for i, (p, r) in enumerate(zip(prompts, out.results)):
        ref = _hf_greedy(loaded.model, p, NEW)
        if r.token_ids != ref:
            first = next(j for j, (a, b) in enumerate(zip(r.token_ids, ref)) if a != b)
            mismatches[i] = f"prompt of {len(p)} tokens differs from token {first}"
    probe = bench.snapshots[-1].numerics
    return {
        "arch": arch, "backend": backend, "mismatches": mismatches, "generated": out.stats.generated_tokens,
        "probe_rmse": probe.rmse_ratio if probe is not None and probe.ok else None,
        "concurrency": out.stats.max_concurrency, "bench": bench, "cache": out.stats.cache,
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_arch_greedy_equals_hf(arch):
    res = compare_with_hf(arch, "torch")
    assert res["mismatches"] == {} and res["generated"] == 8 * NEW and res["concurrency"] == 8
    assert res["probe_rmse"] is not None and res["probe_rmse"] <= 1e-5
    # every attention layer cached, and the runner used its caches (a full re-forward each step would
    # give HF's tokens too)
    assert uncached_attention_left(res["bench"].snapshots) == {}
    assert not res["cache"].startswith(UNCACHED_RUNNER), res["cache"]
    if arch in MLA_ARCHS:
        hist = res["bench"].snapshots[-1].op_histogram
        mla = res["bench"].snapshots[0].op_histogram.get("workbench.torch_mla.default")  # one per attention
        assert mla and hist.get("workbench.torch_cached_mla.default") == mla, hist
    worst, compared, _ = decode_vs_reforward(res["bench"], prompts_for(512)[3:6], steps=4, join_at=1)
    # fp32 round-off, which the tiny models' init (gain ~2.4 per layer, models/tiny.py) amplifies to
    # ~3e-5 in the deepest hybrids (6e-5 for qwen3_next with torch's AVX2 kernels); a missing cache
    # moves the logits by a good part of their RMS
    assert compared == 12 and worst <= 1e-4, worst


def _triton_archs():
    if GPU or os.environ.get("WORKBENCH_TRITON_E2E") == "all":
        return ARCHS
    return ["llama"]


@pytest.mark.skipif(GPU, reason="on a GPU the triton backend runs compiled in test_tiny_arch_triton_gpu")
@pytest.mark.skipif(bool(INTERPRETER_SKIP), reason=INTERPRETER_SKIP)
def test_tiny_archs_triton_backend_equals_hf():
    archs = _triton_archs()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "--triton-child", *archs], env=env, capture_output=True,
                          text=True, timeout=600 * len(archs), cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["arch"] for r in results] == archs
    for r in results:
        assert r["mismatches"] == {} and r["generated"] == 8 * NEW, r
        assert r["probe_rmse"] is not None and r["probe_rmse"] <= 1e-5, r


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_arch_gpu(arch, backend):
    res = compare_with_hf(arch, backend, device="cuda")
    assert res["mismatches"] == {} and res["generated"] == 8 * NEW


def _triton_child(archs) -> None:
    torch.set_num_threads(1)
    out = []
    for arch in archs:
        res = compare_with_hf(arch, "triton")
        res.pop("bench")
        out.append(res)
    print(json.dumps(out))


if __name__ == "__main__" and "--triton-child" in sys.argv:
    _triton_child(sys.argv[sys.argv.index("--triton-child") + 1:])
