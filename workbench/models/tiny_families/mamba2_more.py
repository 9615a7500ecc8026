"""Tiny random configs of more families that carry the Mamba-2 mixer under their own class names.

The canonical mixer patch recognises these by structure (``workbench.models.canonical.ssm``), so
they export through ``torch_causal_conv1d`` + ``torch_ssm`` with no per-family code; these configs
are what proves it. Mixer sizes as ``tiny_families/ssm.py`` (hidden 64, expand 2: 8 SSM heads of
16, state 16, one group, conv kernel 4, chunk 16), vocab 512.

* ``granitemoehybrid``: Granite 4.0 hybrid (``GraniteMoeHybridMambaLayer``): 4 layers, the second
  full attention with RoPE, every layer a top-2 MoE of 4 experts plus a shared MLP, Granite's muP
  multipliers away from 1.
* ``zamba2``: Zamba2 (``Zamba2MambaMixer``): 4 layers, Mamba-2 / hybrid / Mamba-2 / hybrid; each
  hybrid layer runs the one *shared* transformer block (attention over [hidden, original
  embedding] concatenated, 4 heads of 32, RoPE) with its own LoRA adapters, then a
  linear back to the stream, then its Mamba-2 mixer.

Weights: the strong-oracle defaults of ``workbench.models.tiny`` (untied head) at init std 0.1 (Granite
as its MoE siblings in ``more_moe``; Zamba2 because at 0.3 its fp32 round-off, amplified through the
shared block, reaches 3e-4 of the logits' scale between two equally exact scan orders), then, for every test and ``workbench check`` row,
``checkpoint_like_ssm_weights`` re-draws the mixers (finding them by the same structure) so their
state carries over dozens of tokens.
"""

from __future__ import annotations

from .more_moe import GRANITE_MOE
from .sizes import MLP_WIDTH, TRANSFORMER, WIDTH
from .spec import tiny_config
from .ssm import HYBRID_SSM

#: Mamba-2 sizes in Zamba2's spelling (its head dim follows from expand * hidden / heads = 16).
ZAMBA2_SSM: dict = dict(
    n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=1, mamba_d_conv=4, mamba_expand=2, chunk_size=16
)
#: Zamba2's one shared transformer block (``num_mem_blocks=1``: both hybrid layers share its attention
#: and MLP weights), each hybrid layer with its own adapters (``use_shared_attention_adapter``).
ZAMBA2_SHARED_BLOCK: dict = dict(
    num_attention_heads=4,
    num_key_value_heads=4,  # HF's k/v adapters add [b, s, 2 * hidden]: they need as many KV heads as query heads
    num_mem_blocks=1,
    use_shared_attention_adapter=True,
    adapter_rank=8,
    use_mem_rope=True,
)

ARCHS: dict = {
    # Granite spells the Mamba-2 sizes as Bamba does (``ssm.HYBRID_SSM``: ``mamba_*``).
    "granitemoehybrid": tiny_config(
        "GraniteMoeHybridConfig",
        TRANSFORMER,
        HYBRID_SSM,
        GRANITE_MOE,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        position_embedding_type="rope",
        shared_intermediate_size=64,
    ),
    "zamba2": tiny_config(
        "Zamba2Config",
        WIDTH,
        MLP_WIDTH,
        ZAMBA2_SSM,
        ZAMBA2_SHARED_BLOCK,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        initializer_range=0.1,
    ),
}
