"""Tiny random config of RecurrentGemma (Griffin): RG-LRU recurrent blocks alternating with local attention.

Merged into ``workbench.models.tiny.TINY_ARCHS`` as ``recurrent_gemma``. Sizes: hidden 64, 4 heads
(attention head_dim 16, RoPE on half of it as HF defaults), MQA (1 KV head, as the checkpoints),
an RG-LRU width equal to hidden (as in the checkpoints) in 4 block-diagonal gate heads of 16, conv
width 4, vocab 512 (a width other than hidden breaks HF's own cached ``generate`` on a one-token
prompt, transformers 5.23: ``_setup_cache`` sizes the conv state with ``hidden_size``). Three
layers, ``recurrent, recurrent, attention`` (HF's default block pattern); a local-attention window of 8 tokens, so prompts of a few dozen tokens
exercise the sliding window; the logits soft-cap (30) stays HF's.

HF's own init (``_init_weights``, which ignores ``initializer_range`` here) draws ``recurrent_param``
so that the per-token decay is ``u^(4 r)`` with u uniform in [0.81, 0.998] and the gate
``r = sigmoid(gate_a)`` near 0.5 (gate weights std sqrt(0.01 / 16)): decays of ~0.66..0.99, memories
of a few to ~100 tokens, so no re-draw is needed for the state to matter
(``tests/test_family_rglru.py`` checks that tokens reaching a logit only through the carried state
move it by percents).
"""

from __future__ import annotations

from .sizes import WIDTH
from .spec import tiny_config

ARCHS: dict = {
    "recurrent_gemma": tiny_config(
        "RecurrentGemmaConfig",
        WIDTH,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=256,  # the MLP uses half of it per branch (HF's convention): 128
        lru_width=64,
        attention_window_size=8,
        conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"],
    )
}

#: The recurrent block class of the family (what ``models/canonical/rglru.py`` patches).
RECURRENT_BLOCK_CLASSES = ("RecurrentGemmaRecurrentBlock",)
