"""Tiny random configs of the chunked-local-attention family, and of a model that makes tensors inside
its forward (merged into ``workbench.models.tiny.TINY_ARCHS``).

Llama 4's text model interleaves *chunked* attention layers (a query sees only the keys of its own
chunk of ``attention_chunk_size`` absolute positions, causally: ``masking_utils``'s
``chunked_causal_mask_function``; these layers use RoPE and QK L2-norm) with full-attention NoPE
layers (no RoPE, attention temperature tuning), and dense MLP layers with mixture-of-experts ones
(a sigmoid router picks one expert per token, plus a shared expert). Here: layer 0 chunked + dense
MLP, layer 1 full NoPE + MoE (4 experts), chunks of ``CHUNK`` tokens -- shorter than the test
prompts, so the chunk boundary really hides keys in prefill and in decode.

Temperature tuning scales NoPE queries by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``
with ``pos`` counted by HF from ``arange(seq)`` (plus the cache length): it is 1 below
``floor_scale`` (8192) positions, which every tiny run stays under.

Falcon's multi-query attention (Falcon-7B/40B: ``multi_query=True``, ``new_decoder_architecture=False``)
splits its fused QKV projection with ``fused_qkv[..., [-2], :]`` / ``[..., [-1], :]``: each list index
becomes an index tensor made inside ``forward``, which export lifts into the graph (two per layer).
Four layers, so that export's layer stamping meets them too.
"""

from __future__ import annotations

from .sizes import COMMON, SMALL_TOKEN_IDS, WIDTH
from .spec import tiny_config

#: Chunk size of the chunked layers: shorter than the test prompts (see the module docstring).
CHUNK = 4

ARCHS: dict = {
    # Llama 4 (Scout/Maverick) text stack at toy size: a chunked RoPE layer, then a full NoPE MoE layer.
    "llama4_text": tiny_config(
        "Llama4TextConfig",
        COMMON,
        intermediate_size=64,  # MoE experts' width
        intermediate_size_mlp=128,  # the dense layers' MLP
        num_local_experts=4,
        num_experts_per_tok=1,
        moe_layers=[1],
        no_rope_layers=[1, 0],  # 1: RoPE (and chunked attention), 0: NoPE (full attention)
        attention_chunk_size=CHUNK,
        **SMALL_TOKEN_IDS,
    ),
    # Falcon-7B shape: multi-query attention (one K/V head), parallel attention + MLP, RoPE.
    "falcon_mqa": tiny_config(
        "FalconConfig",
        WIDTH,
        num_hidden_layers=4,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        alibi=False,
        ffn_hidden_size=128,
        tie_word_embeddings=False,  # tied, the tiny random model's greedy tokens repeat one token
        **SMALL_TOKEN_IDS,
    ),
}
