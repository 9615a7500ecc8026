"""``append_paged_kv``: one Triton launch writes a step's new K/V rows into the paged caches, finding
each row's sequence from ``seq_lens`` itself. Checked against the tensor-op reference
(``torch_cached_attention.write_kv``) on mixed steps: prefill chunks and decode rows, a sequence
with no new rows, pages out of order, bf16 caches fed fp32 rows. On CPU under the Triton
interpreter (a child process), compiled on a GPU."""

from __future__ import annotations

import sys

import pytest
import torch
from triton_child import child_main, interpreter_results_fixture

# (seq_lens, input_pos, pages per sequence): prefill chunks first, then decode rows
STEPS = {
    "decode_only": ([1, 1, 1], [0, 17, 40], 4),
    "mixed": ([5, 3, 1, 1], [0, 14, 33, 2], 4),
    "empty_sequence": ([4, 0, 2, 1], [3, 7, 15, 0], 3),
    "one_long_prefill": ([37], [5], 4),
}


def _case(seq_lens, input_pos, max_pages, device="cpu", cache_dtype=torch.float32, row_dtype=torch.float32):
    from workbench.ops.attention.torch_cached_attention import token_layout, write_kv
    from workbench.ops.attention.triton_kernels.paged_kv_append import append_paged_kv

    page_size, hkv, d = 16, 3, 40  # head dim 40: padded to 64 inside the kernel
    b, t = len(seq_lens), sum(seq_lens)
    num_pages = b * max_pages + 2
    g = torch.Generator().manual_seed(sum(seq_lens) + b)
    pages = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages).to(torch.int32)
    k = torch.randn(t, hkv, d, generator=g).to(device=device, dtype=row_dtype)
    v = torch.randn(t, hkv, d, generator=g).to(device=device, dtype=row_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    pos = torch.tensor(input_pos, dtype=torch.int32, device=device)
    table = pages.to(device)
    caches = [torch.zeros(num_pages, page_size, hkv, d, dtype=cache_dtype, device=device) for _ in range(4)]
    seq_idx, positions = token_layout(lens, pos, t)
    write_kv(k, v, caches[0], caches[1], seq_idx, positions, table)
    append_paged_kv(k, v, caches[2], caches[3], lens, pos, table)
    if cache_dtype == row_dtype or device != "cpu":
        assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    else:  # the interpreter may round fp32 -> bf16 differently from torch (by one unit in the last place)
        for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    assert caches[2].abs().sum() > 0  # something was written


def _interpreter_checks():
    checks = {name: (lambda s=s: _case(*s)) for name, s in STEPS.items()}
    checks["bf16_cache_fp32_rows"] = lambda: _case(*STEPS["mixed"], cache_dtype=torch.bfloat16)
    checks["bf16"] = lambda: _case(*STEPS["mixed"], cache_dtype=torch.bfloat16, row_dtype=torch.bfloat16)
    return checks


interpreter_results = interpreter_results_fixture(__file__)


@pytest.mark.parametrize("case", [*STEPS, "bf16_cache_fp32_rows", "bf16"])
def test_append_paged_kv_under_the_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the compiled Triton kernel")
@pytest.mark.parametrize("case", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_append_paged_kv_on_gpu(case, dtype):
    _case(*STEPS[case], device="cuda", cache_dtype=dtype, row_dtype=dtype)
    _case(*STEPS[case], device="cuda", cache_dtype=dtype, row_dtype=torch.float32)  # cast on the way in


if __name__ == "__main__":
    child_main(_interpreter_checks)
    sys.exit(0)
