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

#: What every ALiBi tiny config shares: 2 layers of 4 heads (head dim 16), untied lm head.
_HEADS = 4
_LAYERS = 2


def _bloom():
    """BLOOM at toy size (refuses SDPA: its attention is one eager baddbmm/bmm chain)."""
    from transformers import BloomConfig

    config = BloomConfig(
        hidden_size=WIDTH["hidden_size"],
        vocab_size=WIDTH["vocab_size"],
        n_layer=_LAYERS,
        n_head=_HEADS,
        tie_word_embeddings=False,
        initializer_range=0.03,
    )
    config._attn_implementation = "eager"
    return config


def _mpt():
    """MPT at toy size (eager attention only; ``max_seq_len`` bounds the bias table)."""
    from transformers import MptConfig

    config = MptConfig(
        d_model=WIDTH["hidden_size"],
        vocab_size=WIDTH["vocab_size"],
        max_seq_len=WIDTH["max_position_embeddings"],
        n_layers=_LAYERS,
        n_heads=_HEADS,
        expansion_ratio=2,  # MLP 128 wide, like the other tiny models
        tie_word_embeddings=False,
        initializer_range=0.03,
    )
    config._attn_implementation = "eager"
    return config


def _falcon_alibi(attn: str = "sdpa"):
    """Falcon-RW (falcon-rw-1b/7b) at toy size: ALiBi instead of RoPE."""
    from transformers import FalconConfig

    config = FalconConfig(
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
    config._attn_implementation = attn
    return config


def _falcon_alibi_eager():
    """Falcon-RW with HF's eager attention (the bias enters the logits twice there)."""
    return _falcon_alibi("eager")


ARCHS: dict = {"bloom": _bloom, "mpt": _mpt, "falcon_alibi": _falcon_alibi, "falcon_alibi_eager": _falcon_alibi_eager}
