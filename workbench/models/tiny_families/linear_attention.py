"""Tiny random configs of the linear-attention families (merged into ``workbench.models.tiny.TINY_ARCHS``).

* ``minimax``: MiniMax-Text-01's hybrid: 4 layers -- lightning (linear) attention, full softmax
  attention, lightning attention, full attention -- every layer's MLP a top-2 MoE of 4 experts of
  width 64. Lightning attention: 4 heads of 16 (its heads are ``num_attention_heads`` of
  ``head_dim``), silu on the fused q/k/v projection, a per-layer and per-head decay
  (``slope_rate``: 1/4, 1/16, 1/64, 1/256 in layer 0, a third of that in layer 2), an RMSNorm over
  all heads and a sigmoid output gate. HF's block size is 16 (default 256), so the check's prompts
  span several of HF's blocks and its inter-block recurrence runs too. Full attention: the shared
  4 query / 2 KV heads of 16. Hidden 64, vocab 512; init std 0.1 and an untied head (``sizes.ORACLE_STD_0_1``).

The decays above are slow enough (a memory of 4 to several hundred tokens) that the carried state
moves the outputs well above fp32 resolution with HF's own init (``tests/test_family_minimax.py``
checks it): no re-drawing is needed.
"""

from __future__ import annotations

from .sizes import LINEAR_THEN_FULL_TWICE, ORACLE_STD_0_1, SMALL_TOKEN_IDS, TOP2, TRANSFORMER
from .spec import tiny_config

ARCHS: dict = {
    "minimax": tiny_config(
        "MiniMaxConfig",
        TRANSFORMER,
        # Init std 0.1 with an untied head: at ``ORACLE``'s 0.3 the four layers and the top-2 routing
        # amplify fp32 round-off so much that HF's own fp32 logits sit 4.4e-5 (of their largest
        # magnitude) from HF in fp64, and the cached decode drifts from a full re-forward by 4.6e-5 RMSE
        # (tokens still equal); at 0.1 that drift is 4e-7 and HF's greedy tokens still hold 13-16
        # distinct ids per prompt.
        ORACLE_STD_0_1,
        SMALL_TOKEN_IDS,
        LINEAR_THEN_FULL_TWICE,  # lightning attention first, then full attention, twice
        intermediate_size=64,  # the experts' width
        block_size=16,
        num_local_experts=4,
        **TOP2,
    )
}

__all__ = ["ARCHS"]
