"""``workbench::cpu_cached_attention``: the paged cached attention with a C++ kernel for CPU decode.

Same schema, semantics and fake as ``torch_cached_attention`` (the reference it is tested
against); its kernel is ``workbench/ops/cpu_kernels/attention.cpp``: decode-only steps with fp32
tensors run there (one pass per sequence and KV head, online softmax, window/cap/sinks honoured),
everything else (prefill, chunked prefill, other dtypes) is handed to the reference op. Backend
``cpu`` of ``insert_cached_attention`` (its availability is ``workbench.ops.cpu_kernels.is_available``:
unavailable, with the reason, where the kernels cannot be built -- no variant for this CPU, no compiler).
"""

from __future__ import annotations

from ..library import declare_op
from .cached_attention_schema import CACHED_ATTENTION_ARGS, cached_attention_fake

cpu_cached_attention = declare_op(
    "cpu_cached_attention" + CACHED_ATTENTION_ARGS,
    cached_attention_fake,
    host_sync="a C++ CPU kernel that reads the step metadata on the host",
    category="attention",
)
