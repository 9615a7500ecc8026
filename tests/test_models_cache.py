"""The converted-GGUF disk copy gives exactly the weights, tokenizer and chat template of the GGUF."""

from pathlib import Path

import pytest
import torch

from workbench.models import load_model
from workbench.models.export_contract import CausalLMLogits, make_batch
from workbench.models.factory import converted_cache_dir


@pytest.mark.slow
def test_converted_copy_equals_direct_gguf_load(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", "off")
    direct = load_model("smollm2")
    assert "converted copy" not in direct.source
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    first = load_model("smollm2")  # converts and keeps the copy
    second = load_model("smollm2")  # reads the copy
    assert "converted copy" in second.source
    assert (converted_cache_dir(Path(direct.source)) / "config.json").is_file()
    batch = make_batch(49152, 2, 9, seed=5)
    with torch.no_grad():
        ref = CausalLMLogits(direct.model)(*batch.args)
        for m in (first, second):
            assert torch.equal(CausalLMLogits(m.model)(*batch.args), ref)
    assert second.model.lm_head.weight is second.model.model.embed_tokens.weight  # still tied
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert second.tokenizer.apply_chat_template(chat, tokenize=False) == direct.tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert second.tokenizer("hello world")["input_ids"] == direct.tokenizer("hello world")["input_ids"]
