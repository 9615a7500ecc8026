"""Tiny configs of families whose eager attention predates HF's shared ``eager_attention_forward``:
logits replaced through a causal table the module registers (``pipeline/transforms/attention/legacy.py``).

* ``gpt_neo``: GPT-Neo: unscaled logits, ``torch.where(bias, w, finfo.min)`` with a boolean table
  (banded on local layers: window 4, shorter than the check prompts), one local and one global layer.
* ``ctrl``: CTRL: scores scaled by sqrt(d) with a ``triu`` mask made in forward added times -1e4,
  sinusoidal positions.
* ``biogpt``: BioGPT: SDPA over a causal mask and an all-ones padding mask made in forward, indexed
  by key position (classified on plain positions: the probe's large ones index out of range).
* ``xglm``: XGLM: BART-style attention -- the query scaled before the product, heads folded into the
  batch for two ``bmm``s, the masked logits clamped at ``finfo.min`` (``attention/bmm_heads.py``),
  sinusoidal positions, embeddings scaled by sqrt(d).
* ``openai_gpt``: the first GPT: ``Conv1D`` projections, the key permuted straight to [b, h, d, s],
  logits divided by sqrt(d) and hidden as ``w * b - 1e4 * (1 - b)`` with a float 0/1 table.

GPT-Neo, OpenAI GPT and XGLM run HF's eager attention (their only implementation), CTRL and BioGPT SDPA.
Sizes and init as ``more_dense`` (an lm head of its own, std 0.3; OpenAI GPT's ``Conv1D`` projections
keep their constructor's 0.02, ``models/build.py``).
"""

from __future__ import annotations

from .more_dense import GPT_SHAPE, MHA, oracle_config
from .sizes import MLP_WIDTH, ORACLE, WIDTH
from .spec import tiny_config

ARCHS: dict = {
    "gpt_neo": oracle_config(
        "GPTNeoConfig",
        WIDTH,
        MLP_WIDTH,
        num_layers=2,
        num_heads=4,
        attention_types=[[["local", "global"], 1]],
        window_size=4,
        attention="eager",
    ),
    "openai_gpt": oracle_config("OpenAIGPTConfig", GPT_SHAPE, attention="eager"),
    # std 0.05: at 0.3 HF's greedy tokens on one check prompt hold 3 distinct ids, at 0.05 >= 9
    "ctrl": tiny_config("CTRLConfig", GPT_SHAPE, ORACLE, dff=128, initializer_range=0.05),
    "biogpt": oracle_config("BioGptConfig", MHA),
    "xglm": oracle_config(
        "XGLMConfig",
        vocab_size=512,
        max_position_embeddings=512,
        d_model=64,
        ffn_dim=128,
        num_layers=2,
        attention_heads=4,
    ),
}
