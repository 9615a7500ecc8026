"""``workbench::torch_attention_repeat_kv``: HF's ``repeat_kv`` as one node.

Grouped-query attention stores ``n_kv`` K/V heads; eager code repeats each one ``n_rep`` times so
plain multi-head attention can consume them (an unsqueeze/expand/reshape chain in the graph).
Naming the chain lets ``match_sdpa_to_torch_attention`` and ``match_grouped_attention`` drop it
and hand the un-repeated K/V to ``torch_attention``, which does GQA natively::

    x [b, n_kv, s, d] -> out [b, n_kv * n_rep, s, d]   (output head h reads KV head h // n_rep)
"""

from __future__ import annotations

import torch

from ..library import workbench_op


@workbench_op("torch_attention_repeat_kv", category="attention")
def torch_attention_repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # repeat_interleave always allocates, so the output never aliases x (custom ops must not).
    return torch.repeat_interleave(x, n_rep, dim=1)


@torch_attention_repeat_kv.register_fake
def _torch_attention_repeat_kv_fake(x, n_rep):
    b, n_kv, s, d = x.shape
    return x.new_empty(b, n_kv * n_rep, s, d)
