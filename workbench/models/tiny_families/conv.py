"""Tiny random configs of the short causal conv families (merged into ``workbench.models.tiny.TINY_ARCHS``).

* ``lfm2``: LFM2: short-conv layers (3-tap depthwise causal conv, gated) interleaved with GQA attention.

  Three layers, conv / attention / conv: two conv layers, so one layer's conv state cannot
  stand in for another's, within the tiny registry's limit of 3 layers. The shared tiny sizes
  otherwise: hidden 64, 4 query / 2 KV heads, vocab 512, ``head_dim`` 16 (what LFM2 derives
  from hidden / heads; set so the config answers ``head_dim`` like the other tiny archs).
  ``block_auto_adjust_ff_dim`` off: LFM2 otherwise rescales the MLP width to 2/3 and rounds it
  up to ``block_multiple_of`` (256). ``conv_bias`` on, so the conv's bias path is exercised too
  (LFM2 checkpoints ship without it). ``initializer_range`` 0.2 instead of 0.02: at 0.02 the
  random mixers barely move the residual stream and greedy decoding repeats one token forever,
  so a generation test could not tell a conv that remembers its past from one that does not; at
  0.2 (checked, seed 0) 16 greedy tokens are mostly distinct.
"""

from __future__ import annotations

from .sizes import TRANSFORMER
from .spec import tiny_config

ARCHS: dict = {
    "lfm2": tiny_config(
        "Lfm2Config",
        TRANSFORMER,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        block_auto_adjust_ff_dim=False,
        conv_L_cache=3,
        conv_bias=True,
        initializer_range=0.2,
    )
}
