"""Tiny random configs of the architectures with a custom canonical-op model (``workbench.models.custom``)
that no other tiny family covers yet (merged into ``workbench.models.tiny.TINY_ARCHS``).

* ``deepseek_v3``: DeepSeek-V3's shape at toy size. MLA with every dim distinct (4 heads, low-rank
  queries of rank 24, latent 32, rope 8, nope 16, value 16) and the checkpoints' interleaved rope
  pairs; YaRN RoPE with ``mscale_all_dim`` (so the softmax scale carries DeepSeek's temperature
  correction and cos/sin the attention factor); 4 layers, the first dense (``first_k_dense_replace=1``),
  then MoE: 8 routed experts in 4 groups of 2, the best 2 groups kept, top-2 experts, 1 shared expert,
  normalised weights times 2.5. Layers 1-3 are identical, so ``export_to_gm`` stamps layer 3.
  Qwen3-Next, the other custom model, already has ``tiny:qwen3_next`` (``tiny_families/delta_rule.py``).
"""

from __future__ import annotations

from .sizes import MLA_DIMS, MLA_HEADS, MLP_WIDTH, WIDTH
from .spec import tiny_config

#: DeepSeek-V3's routing at toy size: 8 experts of width 32 in 4 groups, 2 groups kept, top-2, 1 shared.
DEEPSEEK_V3_MOE: dict = dict(
    moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1
)


ARCHS: dict = {
    "deepseek_v3": tiny_config(
        "DeepseekV3Config",
        WIDTH,
        MLP_WIDTH,
        MLA_HEADS,
        MLA_DIMS,
        DEEPSEEK_V3_MOE,
        num_hidden_layers=4,
        q_lora_rank=24,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
}
