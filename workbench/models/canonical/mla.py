"""Canonical forwards for multi-head latent attention (DeepSeek-V2 / V3 MLA and the families that
copy V3's: GLM-4-MoE-Lite, Youtu, MiniCPM3, LongCat-Flash with its LoRA scales).

HF's ``DeepseekV2Attention`` / ``DeepseekV3Attention`` (and the copies) compute, per layer::

    q = q_proj(h)  or  q_b_proj(q_a_layernorm(q_a_proj(h)))     -> [b, s, n, dn + dr]: q_nope | q_pe
    kv_nope | k_pe = kv_a_proj_with_mqa(h)                       -> latent [b, s, r], rope key [b, s, dr]
    latent = kv_a_layernorm(kv_nope)                             (what a latent cache stores)
    q_pe, k_pe = rope(q_pe, k_pe)                                (k_pe: one head shared by all)
    k = [kv_b_proj(latent)[:dn per head], k_pe], v = kv_b_proj(latent)[dn: per head]
    o_proj(sdpa(q, k, v, causal, module.scaling))

and export that as ~40 nodes around an SDPA over *expanded* per-head K and V: a cache stage
working on that graph could only cache the expanded K/V (n * (dn + dr + dv) values per token, 4x
the latent in the tiny config, ~71x in DeepSeek-V2). Here the attention core from the latent on is
``torch.ops.workbench.torch_mla(q_nope, q_pe, latent, k_pe, kv_b_proj.weight, scale=module.scaling)``,
whose inputs are exactly what ``insert_cached_mla_attention`` caches. The projections, both
RMSNorms and the RoPE stay plain torch code (the usual matchers still see them); the activations
are laid out ``[b, s, heads, dim]`` (no transposes: the cached op flattens tokens as they come).

Only module attributes both the older (5.17-era: ``q_proj`` present only without ``q_lora_rank``,
plain ``qk_head_dim ** -0.5`` scaling, expanded-K/V caching) and the current (5.23) HF classes
define are read: ``q_lora_rank``, ``q_proj`` / ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, the head dims and ``scaling``.

RoPE, as each family spells it:
* V2: complex multiplication by ``freqs_cis [b, s, dr/2]`` (what the model's rotary embedding
  returns), on interleaved pairs -- HF's ``apply_rotary_emb``, with the head axis at 2;
* V3 and its copies: cos/sin ``[b, s, dr]``; ``config.rope_interleave`` (DeepSeek-V3 checkpoints; MiniCPM3
  never interleaves, ``COS_SIN_ROPE``): the pairs are
  de-interleaved first (``[x0, x2, ..] | [x1, x3, ..]``, the same for q and k, so the scores are
  unchanged) then rotate-half -- bit-identical to HF 5.23's even/odd-slice spelling, and the
  spelling ``match_rope_pattern`` knows; otherwise plain rotate-half.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import ModulePatch


def _require_uncached(module: Any, past_key_values) -> None:
    if past_key_values is not None:
        raise ValueError(
            f"the canonical {type(module).__name__} forward is for export (use_cache=False): the cached graph keeps "
            "MLA latents through insert_cached_mla_attention, not an HF cache object"
        )


def _require_causal(
    module: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> None:
    """torch_mla is causal attention over whole sequences; check that the mask says nothing more.

    The export contract (``input_ids, position_ids``) has no padding-mask input, so the 4D mask HF
    builds while tracing (it cannot skip it for a symbolic sequence length) is a function of the
    sizes and positions only: causal, since DeepSeek configs have no sliding window (refused below
    if one appears), and packed-sequence detection is off during export (``no_packed_sequence_mask``).
    The pattern matcher proves the same of SDPA masks by probing them (``classify_mask``); here the
    mask is dropped, exactly like the causal ones the matcher drops.
    """
    window = getattr(module.config, "sliding_window", None)
    if window is not None:
        raise ValueError(
            f"{type(module).__name__}: config.sliding_window={window}, but torch_mla is plain causal "
            "attention; disable this export patch to export HF's own spelling"
        )
    if attention_mask is None:
        return
    s = hidden_states.shape[1]
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != s:
        raise ValueError(
            f"the canonical {type(module).__name__} forward computes causal attention over the new tokens only, but "
            f"got an attention_mask {tuple(attention_mask.shape)} for {s} tokens (a KV cache or padding?). Export "
            "through the workbench contract (input_ids, position_ids), or disable this export patch"
        )


def _queries(module: Any, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """q_nope [b, s, n, dn], q_pe [b, s, n, dr] (not yet rotated)."""
    b, s = hidden_states.shape[:-1]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(b, s, -1, module.qk_head_dim)
    return q[..., : module.qk_nope_head_dim], q[..., module.qk_nope_head_dim :]


def _latent(module: Any, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """latent [b, s, r] (after kv_a_layernorm), k_pe [b, s, 1, dr] (not yet rotated)."""
    b, s = hidden_states.shape[:-1]
    kv = module.kv_a_proj_with_mqa(hidden_states)
    latent = module.kv_a_layernorm(kv[..., : module.kv_lora_rank])
    return latent, kv[..., module.kv_lora_rank :].view(b, s, 1, module.qk_rope_head_dim)


def _attend(module: Any, hidden_states, q_nope, q_pe, latent, k_pe) -> torch.Tensor:
    """torch_mla, then o_proj: [b, s, hidden]."""
    import workbench.ops.mla  # noqa: F401  (registers the op; a no-op once workbench.ops imports it)

    b, s = hidden_states.shape[:-1]
    out = torch.ops.workbench.torch_mla(
        q_nope, q_pe, latent, k_pe, module.kv_b_proj.weight, scale=float(module.scaling)
    )  # [b, s, n, dv]
    return module.o_proj(out.reshape(b, s, -1))


# ------------------------------------------------------------------------------ DeepSeek-V2


def rope_complex_bsnd(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF DeepSeek-V2's ``apply_rotary_emb`` for [b, s, heads, dr] tensors: each interleaved pair
    ``(x[2i], x[2i+1])`` is one complex number times ``freqs_cis [b, s, dr/2]``; fp32 inside."""
    q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    freqs = freqs_cis.unsqueeze(2)  # [b, s, 1, dr/2]: broadcast over heads
    q_out = torch.view_as_real(q_ * freqs).flatten(3)
    k_out = torch.view_as_real(k_ * freqs).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)


def deepseek_v2_attention_forward(
    module: Any,
    hidden_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    past_key_values=None,
    position_embeddings: Optional[torch.Tensor] = None,
    **kwargs,
):
    """``DeepseekV2Attention.forward`` through ``torch_mla``: [b, s, hidden] -> ([b, s, hidden], None).
    ``position_embeddings``: the complex ``freqs_cis [b, s, dr/2]`` of ``DeepseekV2RotaryEmbedding``."""
    _require_uncached(module, past_key_values)
    _require_causal(module, hidden_states, attention_mask)
    q_nope, q_pe = _queries(module, hidden_states)
    latent, k_pe = _latent(module, hidden_states)
    # HF moves freqs_cis with ``.to(q_pe.device)``: a no-op here (the rotary embedding runs on the
    # hidden states' device) that export records as one shared alias, which every later layer then
    # reads from layer 1 -- and layer stamping (export_stamp) refuses a layer reading its predecessor.
    assert position_embeddings is not None  # DeepseekV2's decoder layer always passes freqs_cis
    q_pe, k_pe = rope_complex_bsnd(q_pe, k_pe, position_embeddings)
    return _attend(module, hidden_states, q_nope, q_pe, latent, k_pe), None


# ------------------------------------------------------------------------------ DeepSeek-V3


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def rope_cos_sin_bsnd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF DeepSeek-V3's rotate-half RoPE for [b, s, heads, dr] tensors, cos/sin [b, s, dr];
    ``interleaved``: de-interleave the pairs first (see the module docstring)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        b, s, h, d = q.shape
        q = q.view(b, s, h, d // 2, 2).transpose(4, 3).reshape(b, s, h, d)
        b, s, h, d = k.shape
        k = k.view(b, s, h, d // 2, 2).transpose(4, 3).reshape(b, s, h, d)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


#: How each cos/sin MLA family pairs the rope dims, by HF attention class: "config" -- interleaved
#: iff ``config.rope_interleave`` (HF's forward branches on it); "half" -- always rotate-half (MiniCPM3
#: keeps the original RoPE whatever its config says); "interleaved" -- always interleaved (LongCat-Flash).
COS_SIN_ROPE: dict = {
    "DeepseekV3Attention": "config",
    "Glm4MoeLiteAttention": "config",
    "YoutuAttention": "config",
    "MiniCPM3Attention": "half",
    "LongcatFlashMLA": "interleaved",
}


def _rope_interleaved(module: Any) -> bool:
    rule = COS_SIN_ROPE.get(type(module).__name__, "config")
    if rule == "interleaved":
        return True
    return rule == "config" and bool(getattr(module.config, "rope_interleave", False))


def _lora_scales(module: Any, q_nope, q_pe, latent):
    """LongCat-Flash scales the queries by ``mla_scale_q_lora`` and the normed latent by
    ``mla_scale_kv_lora`` (before RoPE and before caching, as HF does); other families have neither."""
    q_scale, kv_scale = getattr(module, "mla_scale_q_lora", None), getattr(module, "mla_scale_kv_lora", None)
    if q_scale is not None:
        q_nope, q_pe = q_nope * q_scale, q_pe * q_scale
    if kv_scale is not None:
        latent = latent * kv_scale
    return q_nope, q_pe, latent


def cos_sin_mla_forward(
    module: Any,
    hidden_states: torch.Tensor,
    position_embeddings: Tuple[torch.Tensor, torch.Tensor],
    attention_mask: Optional[torch.Tensor] = None,
    past_key_values=None,
    **kwargs,
):
    """The MLA forward of DeepSeek-V3 and the families that copy it with cos/sin RoPE (GLM-4-MoE-Lite,
    Youtu, MiniCPM3, LongCat-Flash) through ``torch_mla``: [b, s, hidden] -> ([b, s, hidden], None). Any q-LoRA rank
    (or none), rope/nope split and value head dim: the sizes come from the module."""
    # HF 5.23 renamed the cache argument (``cache``; ``past_key_values`` deprecated): refuse either.
    _require_uncached(module, past_key_values if past_key_values is not None else kwargs.get("cache"))
    _require_causal(module, hidden_states, attention_mask)
    q_nope, q_pe = _queries(module, hidden_states)
    latent, k_pe = _latent(module, hidden_states)
    q_nope, q_pe, latent = _lora_scales(module, q_nope, q_pe, latent)
    cos, sin = position_embeddings
    q_pe, k_pe = rope_cos_sin_bsnd(q_pe, k_pe, cos, sin, _rope_interleaved(module))
    return _attend(module, hidden_states, q_nope, q_pe, latent, k_pe), None


PATCHES: tuple = (
    ModulePatch(
        "canonical_deepseek_v2_mla",
        "Export DeepSeek-V2's attention (DeepseekV2Attention) with its latent attention core as "
        "workbench::torch_mla (latent after kv_a_layernorm, rotated rope parts, kv_b_proj weight), so the "
        "cache stage caches the latent instead of per-head K/V.",
        ("DeepseekV2Attention",),
        deepseek_v2_attention_forward,
    ),
    ModulePatch(
        "canonical_deepseek_v3_mla",
        "Export DeepSeek-V3's attention (DeepseekV3Attention) with its latent attention core as "
        "workbench::torch_mla, so the cache stage caches the latent instead of per-head K/V.",
        ("DeepseekV3Attention",),
        cos_sin_mla_forward,
    ),
    ModulePatch(
        "canonical_cos_sin_mla",
        "Export the MLA attention of the families that copy DeepSeek-V3's with cos/sin RoPE "
        "(Glm4MoeLiteAttention, YoutuAttention, MiniCPM3Attention, LongcatFlashMLA) with its latent attention core as "
        "workbench::torch_mla, so the cache stage caches the latent instead of per-head K/V.",
        tuple(c for c in COS_SIN_ROPE if c != "DeepseekV3Attention"),
        cos_sin_mla_forward,
    ),
)
