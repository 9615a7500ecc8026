"""Tiny random configs of the ALiBi families (merged into ``workbench.models.tiny.TINY_ARCHS``).

ALiBi models have no position embedding: each head adds ``slope * (k_pos - q_pos)`` to its attention
logits. Each family spells that bias differently in HF (``pipeline/transforms/attention/alibi.py``
lists the spellings), and each has its own slope formula:

* ``bloom``: BLOOM (eager attention only): ``baddbmm`` with the bias; slopes ``2^(-8 h / n)``.
* ``mpt``: MPT (eager only): a ``[n, 1, max_seq_len]`` bias table sliced per step; slopes from
  ``alibi_bias_max = 8``. ``max_seq_len`` is the tiny models' 512 positions.
* ``falcon_alibi``: Falcon-RW (``alibi=True``: no RoPE, multi-head, sequential attention + MLP,
  biases), SDPA -- Falcon's default -- with the bias folded into the float mask as
  ``alibi / sqrt(head_dim)`` (slopes rounded to bf16 by HF).
* ``falcon_alibi_eager``: the same with HF's eager attention, which adds the bias twice.

Sizes: hidden 64, 2 layers, vocab 512, 4 heads of 16 (these families have no GQA). Greedy decoding
must not collapse into a few repeated tokens (that would hide a wrong cache): the lm head is untied
from the embedding, and each builder sets its own init scale (so ``tiny.oracle_defaults`` keeps it),
chosen so that HF greedy on the check's prompts and on ``tests/test_alibi.py``'s gives >= 8 distinct
tokens in 16: BLOOM 0.03, MPT 0.03, Falcon 0.015. (Checked with transformers 5.23, seed 0: at the
oracle default 0.3, or at 0.1-0.2, some prompts of every family settle into a 1-4 token loop.)
"""

from __future__ import annotations

from .sizes import WIDTH
from .spec import tiny_config

#: What every ALiBi tiny config shares: 2 layers of 4 heads (head dim 16), untied lm head.
_HEADS = 4
_LAYERS = 2

#: Falcon-RW's fields (SDPA and eager alike).
FALCON_RW: dict = dict(
    hidden_size=WIDTH["hidden_size"],
    vocab_size=WIDTH["vocab_size"],
    num_hidden_layers=_LAYERS,
    num_attention_heads=_HEADS,
    alibi=True,
    multi_query=False,
    new_decoder_architecture=False,
    parallel_attn=False,
    bias=True,
    tie_word_embeddings=False,
    initializer_range=0.015,
)

ARCHS: dict = {
    # BLOOM refuses SDPA: its attention is one eager baddbmm/bmm chain.
    "bloom": tiny_config(
        "BloomConfig",
        hidden_size=WIDTH["hidden_size"],
        vocab_size=WIDTH["vocab_size"],
        n_layer=_LAYERS,
        n_head=_HEADS,
        tie_word_embeddings=False,
        initializer_range=0.03,
        attention="eager",
    ),
    # MPT: eager attention only; ``max_seq_len`` bounds the bias table.
    "mpt": tiny_config(
        "MptConfig",
        d_model=WIDTH["hidden_size"],
        vocab_size=WIDTH["vocab_size"],
        max_seq_len=WIDTH["max_position_embeddings"],
        n_layers=_LAYERS,
        n_heads=_HEADS,
        expansion_ratio=2,  # MLP 128 wide, like the other tiny models
        tie_word_embeddings=False,
        initializer_range=0.03,
        attention="eager",
    ),
    # Falcon-RW (falcon-rw-1b/7b): ALiBi instead of RoPE, SDPA (Falcon's default) ...
    "falcon_alibi": tiny_config("FalconConfig", FALCON_RW, attention="sdpa"),
    # ... and HF's eager attention (the bias enters the logits twice there).
    "falcon_alibi_eager": tiny_config("FalconConfig", FALCON_RW, attention="eager"),
}
