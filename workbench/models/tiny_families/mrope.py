"""Tiny random configs of the mRoPE families (merged into ``workbench.models.tiny.TINY_ARCHS``).

``qwen2_5_vl``: the Qwen2.5-VL text stack at the common tiny sizes (hidden 64, 2 layers, 4 query /
2 KV heads, head_dim 16, MLP 128, vocab 512), with ``mrope_section = [2, 3, 3]``: unequal sections
summing to head_dim/2 = 8, so a wrong section split shows up in any test with 3-section positions.
The config is the composite ``Qwen2_5_VLConfig``: transformers has no causal-LM class for the text
stack alone, so the model is ``Qwen2_5_VLForConditionalGeneration`` (built through
``AutoModelForImageTextToText``) with a one-block vision tower that text-only inputs never run.
The export contract ``(input_ids, position_ids [b, s]) -> logits`` is text-only: the text model
broadcasts [b, s] positions to its three sections.

Special token ids (image/video/vision start/end) are moved inside the tiny vocab's top end, and
BOS/EOS are unset, so the config validates without warnings; random prompts may contain the image
token id, which is harmless: without pixel values no token is replaced by vision features.
"""

from __future__ import annotations

from .sizes import GQA_HEADS, MLP_WIDTH, WIDTH
from .spec import tiny_config

#: The common sizes without head_dim (hidden / heads in this family), 2 layers, no BOS/EOS.
TEXT = dict(**WIDTH, **GQA_HEADS, **MLP_WIDTH, num_hidden_layers=2, bos_token_id=None, eos_token_id=None)
MROPE_SECTION = [2, 3, 3]  # temporal, height, width frequencies; sum = head_dim / 2 = 8


ARCHS: dict = {
    "qwen2_5_vl": tiny_config(
        "Qwen2_5_VLConfig",
        # head_dim is hidden/heads in this family (16); the text config has no head_dim field of its own.
        text_config=dict(
            TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TEXT["hidden_size"],
            fullatt_block_indexes=[0],
        ),
        image_token_id=508,
        video_token_id=509,
        vision_start_token_id=510,
        vision_end_token_id=511,
    )
}
