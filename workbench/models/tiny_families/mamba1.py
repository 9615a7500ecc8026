"""Tiny random configs of the Mamba-1 families (merged into ``workbench.models.tiny.TINY_ARCHS``).

Shared mixer sizes: hidden 64 with expand 2 (inner width d = 128 channels), state 16, conv kernel
4, dt rank 4 (``ceil(hidden / 16)``, the families' "auto"), vocab 512.

* ``mamba``: pure Mamba-1, 4 identical layers (so ``export_to_gm`` stamps layers 3.. from layer 2).
* ``falcon_mamba``: FalconMamba, 2 layers: Mamba-1 with weightless RMS norms on dt, B and C.
* ``jamba``: 4 layers -- Mamba, attention, Mamba, Mamba (``attn_layer_period`` 4, offset 1) -- with
  the MoE feed-forward (4 experts, top 2) on the odd layers; its mixers norm dt, B and C with
  weighted RMS norms.

HF's init already makes the state matter (no re-draw, unlike the Mamba-2 families): with the tiny
init (std 0.3) the dt projection spreads the steps widely, and Mamba / FalconMamba draw
``dt_proj.bias`` for steps of 0.001..0.1 (long memories). Measured on 40-token inputs (seed 1):
zeroing the carried state (decay 0) moves the mixers' outputs by 33-93% (Mamba), 27-36%
(FalconMamba) and 11-24% of their largest value (Jamba, whose bias starts at 0: shorter memories).
"""

from __future__ import annotations

from .sizes import TRANSFORMER, WIDTH
from .spec import tiny_config

#: Mamba-1 mixer sizes in Mamba / FalconMamba spelling.
MAMBA1: dict = dict(state_size=16, expand=2, conv_kernel=4, time_step_rank=4)
#: The same mixer sizes in Jamba's spelling.
JAMBA_MAMBA1: dict = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)

ARCHS: dict = {
    # Pure Mamba-1. ``MambaForCausalLM`` has no attention: its config names eager itself.
    "mamba": tiny_config("MambaConfig", WIDTH, MAMBA1, num_hidden_layers=4, attention="eager"),
    "falcon_mamba": tiny_config("FalconMambaConfig", WIDTH, MAMBA1, num_hidden_layers=2, attention="eager"),
    "jamba": tiny_config(
        "JambaConfig",
        TRANSFORMER,
        JAMBA_MAMBA1,
        num_hidden_layers=4,
        attn_layer_period=4,  # attention on layer 1 of every 4: Mamba, attention, Mamba, Mamba
        attn_layer_offset=1,
        expert_layer_period=2,  # the MoE feed-forward on the odd layers
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}


__all__ = ["ARCHS", "MAMBA1"]
