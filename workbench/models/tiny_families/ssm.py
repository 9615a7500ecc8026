"""Tiny random configs of the Mamba-2 SSM families (merged into ``workbench.models.tiny.TINY_ARCHS``).

Shared SSM sizes: hidden 64 with expand 2, so the mixer's inner width 128 is 8 SSM heads of 16;
state 16, one B/C group, conv kernel 4, chunk size 16 (prompts of a few dozen tokens then span
several chunks, so the inter-chunk recurrence is exercised), vocab 512. Attention layers of the
hybrids use the shared 4 query / 2 KV heads of 16.

* ``mamba2``: pure Mamba-2, 4 identical layers (so ``export_to_gm`` stamps layers 3.. from layer 2).
* ``bamba``: 4 layers, the second full attention, the rest Mamba-2 (heterogeneous: no stamping).
* ``falcon_h1``: 2 layers, each a Mamba-2 mixer and attention side by side, with the gated norm
  (``mamba_rms_norm``, gate applied before normalizing, as Falcon-H1 checkpoints ship) and muP
  multipliers that differ from 1 so each of them is exercised.
* ``nemotron_h``: 4 blocks, Mamba-2 / attention / Mamba-2 / MLP (pattern ``M*M-``); its mixer clamps
  the step size from below (``time_step_limit = (time_step_min, inf)``).

HF's random init leaves the scan nearly idle in these tiny models: the hybrids' mixers get
``dt_bias = 1`` (step ~1.3: a memory of a couple of tokens) and std-0.02 in_proj / conv weights, so
x, B and C are ~0.02 and the state's share of a mixer's output falls below fp32 resolution (D * x is
all that is left). ``checkpoint_like_ssm_weights`` gives the mixers of a loaded tiny model what
trained checkpoints look like -- steps of 0.01..0.1, PyTorch's default Linear / Conv1d init for
in_proj and conv1d -- so the carried state moves the outputs by several percent; the SSM tests run
on such weights.
"""

from __future__ import annotations

import math

from .sizes import TRANSFORMER
from .spec import tiny_config

#: Mamba-2 mixer sizes, in Bamba / Falcon-H1 spelling (``mamba_*``).
HYBRID_SSM: dict = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)
#: Attention and MLP sizes of the hybrids (``workbench.models.tiny.COMMON`` without the layer count).
HYBRID_ATTENTION: dict = TRANSFORMER


ARCHS: dict = {
    # Pure Mamba-2. ``Mamba2ForCausalLM`` refuses sdpa (it has no attention), so its config names eager
    # itself (``build_tiny_config`` sets sdpa only when unset).
    "mamba2": tiny_config(
        "Mamba2Config",
        hidden_size=64,
        num_hidden_layers=4,
        num_heads=8,
        head_dim=16,
        expand=2,
        state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=16,
        vocab_size=512,
        attention="eager",
    ),
    "bamba": tiny_config("BambaConfig", HYBRID_ATTENTION, HYBRID_SSM, num_hidden_layers=4, attn_layer_indices=[1]),
    "falcon_h1": tiny_config(
        "FalconH1Config",
        HYBRID_ATTENTION,
        HYBRID_SSM,
        num_hidden_layers=2,
        mamba_d_ssm=128,  # inner width = heads * head_dim (Falcon-H1 may decouple it from expand * hidden)
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0],  # gate, x, B, C, dt segments of in_proj's output
        ssm_in_multiplier=0.8,
        ssm_out_multiplier=1.1,
        attention_in_multiplier=0.9,
        attention_out_multiplier=1.2,
        mlp_multipliers=[0.7, 1.3],
        embedding_multiplier=1.5,
        lm_head_multiplier=0.6,
    ),
    # The block pattern as a string (``hybrid_override_pattern``, NemotronH's original spelling):
    # recent configs convert it to ``layers_block_type`` for backward compatibility.
    "nemotron_h": tiny_config(
        "NemotronHConfig",
        HYBRID_ATTENTION,
        hybrid_override_pattern="M*M-",
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=16,
    ),
}


#: Mixer classes of the families above (``checkpoint_like_ssm_weights`` finds mixers by structure,
#: ``workbench.models.canonical.ssm.mamba2_mixers``: these and any other family's).
MIXER_CLASSES = ("Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer")


def checkpoint_like_ssm_weights(model, seed: int = 0):
    """Re-draw every Mamba-2 mixer's step bias, in_proj and conv1d (in place; returns ``model``; mixers
    found by structure, ``mamba2_mixers``, whatever their class):
    ``dt_bias = softplus^-1(dt)`` with dt log-uniform in [0.01, 0.1] (Mamba-2's own init recipe,
    narrowed so the time-step limits of the families never bite), in_proj / conv1d with PyTorch's
    default init (uniform, bound 1/sqrt(fan_in)). Seeded, and the caller's RNG is left as it was."""
    import torch

    from ..canonical.ssm import mamba2_mixers

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in mamba2_mixers(model):
            dt = torch.exp(torch.empty(m.dt_bias.shape).uniform_(math.log(0.01), math.log(0.1)))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            m.in_proj.reset_parameters()
            m.conv1d.reset_parameters()
    return model
