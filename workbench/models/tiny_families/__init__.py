"""Tiny random configs of the families behind the cache kinds beyond paged attention: SSM (Mamba-2
and its attention hybrids), delta rule / gated delta rule, MLA, mRoPE. One module per mechanism,
each an ``ARCHS`` dict of ``name -> builder`` in the style of ``workbench.models.tiny``. Most builders are
data, ``spec.TinyConfig`` (the family's config class and its fields, from the shared sizes of ``sizes.py``);
a builder with real logic stays a function."""

from __future__ import annotations

from . import (
    alibi,
    chunked,
    conv,
    custom,
    delta_rule,
    legacy_attention,
    linear_attention,
    mamba1,
    mamba2_more,
    mla,
    more_dense,
    more_moe,
    mrope,
    recent,
    rglru,
    ssm,
)

FAMILY_ARCHS: dict = {**conv.ARCHS, **custom.ARCHS, **ssm.ARCHS, **delta_rule.ARCHS, **mla.ARCHS, **mrope.ARCHS}
FAMILY_ARCHS.update(chunked.ARCHS)  # chunked local attention (Llama 4), forward-made tensors (Falcon MQA)
FAMILY_ARCHS.update(alibi.ARCHS)  # ALiBi position biases (BLOOM, MPT, Falcon-RW)
FAMILY_ARCHS.update({**more_dense.ARCHS, **more_moe.ARCHS})  # more dense and MoE families
FAMILY_ARCHS.update(linear_attention.ARCHS)  # decayed linear attention (MiniMax lightning)
FAMILY_ARCHS.update(rglru.ARCHS)  # RG-LRU recurrence + local attention (RecurrentGemma)
FAMILY_ARCHS.update(mamba2_more.ARCHS)  # Mamba-2 mixers under other names (Granite 4 hybrid, Zamba2)
FAMILY_ARCHS.update(mamba1.ARCHS)  # Mamba-1 selective scan (Mamba, FalconMamba, Jamba)
FAMILY_ARCHS.update(legacy_attention.ARCHS)  # logits replaced through a registered causal table (GPT-Neo, GPT)
FAMILY_ARCHS.update(recent.ARCHS)  # recent decoder-only families (2025-26)

__all__ = ["FAMILY_ARCHS"]
