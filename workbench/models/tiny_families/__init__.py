"""Tiny random configs of the families behind the cache kinds beyond paged attention: SSM (Mamba-2
and its attention hybrids), delta rule / gated delta rule, MLA, mRoPE. One module per mechanism,
each an ``ARCHS`` dict of ``name -> builder`` in the style of ``workbench.models.tiny``."""

from __future__ import annotations

from . import alibi, chunked, conv, custom, delta_rule, mla, more_dense, more_moe, mrope, ssm

FAMILY_ARCHS: dict = {**conv.ARCHS, **custom.ARCHS, **ssm.ARCHS, **delta_rule.ARCHS, **mla.ARCHS, **mrope.ARCHS}
FAMILY_ARCHS.update(chunked.ARCHS)  # chunked local attention (Llama 4), forward-made tensors (Falcon MQA)
FAMILY_ARCHS.update(alibi.ARCHS)  # ALiBi position biases (BLOOM, MPT, Falcon-RW)
FAMILY_ARCHS.update({**more_dense.ARCHS, **more_moe.ARCHS})  # more dense and MoE families

__all__ = ["FAMILY_ARCHS"]
