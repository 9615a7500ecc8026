"""Build the HF fast tokenizer a GGUF file describes, straight from its metadata.

``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes seconds: it re-reads the file,
resolves a config, instantiates a ``GPT2Tokenizer`` only to throw its wrapper away, and imports
every sentencepiece tokenizer class its mapping module mentions. Here the already-parsed
``GGUFFile`` metadata goes straight into a ``tokenizers.Tokenizer`` built the same way
transformers' GGUF converter (``transformers.integrations.gguf.gguf_tokenizer_mapping``) builds
it, so ids, decoding, special tokens and the chat template are identical (tests compare the
two), in ~0.1 s.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen, ...) is
supported; sentencepiece/unigram vocabularies raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from .gguf_file import GGUFFile

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4
# `tokenizer.ggml.pre` values for which transformers keeps GPT-2's own byte-level regex (they are
# not in its GGUF_PRE_TOKENIZER_SPLITS; a test checks that). Any other value is looked up in that
# table, whose import (~0.25 s, it pulls in several tokenizer classes) is thus only paid when needed.
PLAIN_BYTE_LEVEL_PRE = frozenset({"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"})


def _pre_tokenizer_split(pre: str | None) -> str | None:
    """The split regex transformers uses for this ``tokenizer.ggml.pre``, or None for GPT-2's own."""
    if pre is None or pre in PLAIN_BYTE_LEVEL_PRE:
        return None
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return GGUF_PRE_TOKENIZER_SPLITS.get(pre)


def tokenizer_from_gguf(f: GGUFFile) -> PreTrainedTokenizerFast:
    """The tokenizer transformers builds from this GGUF, built directly from ``f.metadata``.

    Same construction as transformers' byte-level GGUF path: a BPE over the file's tokens and
    merges (tokens spelled outside the byte-to-unicode alphabet are re-spelled into it), GPT-2's
    ``ByteLevel`` pre-tokenizer (or the split regex named by ``tokenizer.ggml.pre``) and decoder;
    CONTROL tokens spelled in the byte alphabet become special added tokens, USER_DEFINED ones
    plain added tokens; bos/eos/unk/pad come from the ``*_token_id`` keys; ``add_bos_token``,
    ``add_eos_token`` and ``chat_template`` from the file when it states them.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    md = f.metadata
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"{f.path}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported "
            "here. Use AutoTokenizer.from_pretrained(dir, gguf_file=name) for other tokenizers."
        )
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    token_types = md.get("tokenizer.ggml.token_type")
    token_types = np.asarray(token_types) if token_types is not None else np.zeros(0, np.int32)

    # The vocabulary must be spelled in GPT-2's byte alphabet. A file normally already is; a token
    # using any other character is re-spelled from its UTF-8 bytes (as transformers does).
    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    if alphabet.issuperset("".join(tokens)):  # one set check for the whole vocabulary
        in_alphabet = [True] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
    else:
        in_alphabet = [alphabet.issuperset(tok) for tok in tokens]
        vocab = {
            tok if ok else "".join(spelling[b] for b in tok.encode("utf-8")): i
            for i, (tok, ok) in enumerate(zip(tokens, in_alphabet))
        }
    if "tokenizer.ggml.merges" not in md:
        raise NotImplementedError(
            f"{f.path}: a byte-level BPE vocabulary without tokenizer.ggml.merges is not supported"
        )
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]

    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _pre_tokenizer_split(md.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must match whole and be special, else they are cut into
    # byte pieces; one spelled outside the byte alphabet is a llama.cpp mislabel and is skipped.
    control = np.flatnonzero(token_types == _CONTROL)
    specials = [tokens[i] for i in control if in_alphabet[i]]
    if specials:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [tokens[i] for i in np.flatnonzero(token_types == _USER_DEFINED) if tokens[i] in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    kwargs: dict[str, Any] = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = md.get(f"tokenizer.ggml.{key}")
        kwargs[name] = tokens[token_id] if token_id is not None else None
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in md:
            kwargs[key] = bool(md[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in md:
        kwargs["chat_template"] = md["tokenizer.chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tok.name_or_path = str(f.path)
    return tok
