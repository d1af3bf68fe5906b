"""The tokenizer a GGUF file describes in its metadata (llama.cpp's `tokenizer.ggml.*` keys),
rebuilt with the `tokenizers` library as the tokenizer.json + tokenizer_config.json pair a
Hugging Face checkpoint ships: vocabulary, merges, special tokens, BOS/EOS, chat template.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from replica.builtin_model import bytes_to_unicode
from replica.model.loader import ModelLoadError

# llama.cpp's token types (llama_token_type): what each vocabulary entry is.
TOKEN_TYPE_CONTROL = 3  # special: <|im_start|>, <s>; never split, skipped when decoding
TOKEN_TYPE_USER_DEFINED = 4  # added but not special: matched whole in text, kept when decoding

# How text is split before byte-level BPE, per `tokenizer.ggml.pre` (llama.cpp's pre-tokenizer
# names): the splits the vocabulary's merges were learned on. GPT-2's own regex is ByteLevel's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2")
_SMOLLM_PRE_TOKENIZERS = ("smollm",)  # GPT-2's regex after splitting every digit apart
_LLAMA3_PRE_TOKENIZERS = ("llama3", "llama-v3", "llama-bpe")
SUPPORTED_PRE_TOKENIZERS = _GPT2_PRE_TOKENIZERS + _SMOLLM_PRE_TOKENIZERS + _LLAMA3_PRE_TOKENIZERS
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


class GGUFTokenizerError(ModelLoadError):
    """Tokenizer metadata this module cannot rebuild; the message names the key and value."""


def tokenizer_from_gguf_metadata(metadata: dict[str, Any]) -> Tokenizer:
    """A fast tokenizer equal to the one llama.cpp builds from the same metadata."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {tokenizer_model!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled_tokens = [_byte_level_spelling(token) for token in tokens]
    vocab = {token: index for index, token in enumerate(spelled_tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or []]
    pre_tokenizer_name = metadata.get("tokenizer.ggml.pre", "default")
    # llama.cpp takes a whole word from the vocabulary before merging for Llama 3's vocabulary.
    ignore_merges = pre_tokenizer_name in _LLAMA3_PRE_TOKENIZERS
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre_tokenizer_name)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_CONTROL, special=True))
    tokenizer.add_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_USER_DEFINED, special=False))
    tokenizer.post_processor = _special_token_template(metadata, tokens)
    return tokenizer


def tokenizer_config_from_gguf_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by text, and whether BOS/EOS are added."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds_bos(metadata),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        # Byte-level text must decode exactly as encoded: no space "cleanup".
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    return config


def _adds_bos(metadata: dict[str, Any]) -> bool:
    return bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and "tokenizer.ggml.bos_token_id" in metadata


def _byte_level_pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name in _GPT2_PRE_TOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _SMOLLM_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if name in _LLAMA3_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise GGUFTokenizerError(
        f"tokenizer.ggml.pre {name!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def _byte_level_spelling(token: str) -> str:
    """The token in GPT-2's byte alphabet. Files store it so already; a token that is not (a
    llama.cpp mislabel) is respelled from its UTF-8 bytes, as transformers does."""
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_SYMBOLS[byte] for byte in token.encode("utf-8"))


def _added_tokens(tokens: list[str], token_types: list[int], wanted_type: int, *, special: bool) -> list[AddedToken]:
    # A control token outside the byte alphabet cannot be a real byte-level token (a
    # mislabel); adding it would grow the vocabulary past the model's, so it is left out.
    return [
        AddedToken(token, special=special, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == wanted_type and set(token) <= _BYTE_ALPHABET
    ]


def _special_token_template(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """BOS (and EOS) around each sequence when the file asks for them, as llama.cpp adds them."""
    prefix, suffix, special_tokens = "", "", []
    if _adds_bos(metadata):
        bos_id = metadata["tokenizer.ggml.bos_token_id"]
        prefix = f"{tokens[bos_id]} "
        special_tokens.append((tokens[bos_id], bos_id))
    if metadata.get("tokenizer.ggml.add_eos_token") and "tokenizer.ggml.eos_token_id" in metadata:
        eos_id = metadata["tokenizer.ggml.eos_token_id"]
        suffix = f" {tokens[eos_id]}"
        special_tokens.append((tokens[eos_id], eos_id))
    if not special_tokens:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(
        single=f"{prefix}$A{suffix}", pair=f"{prefix}$A{suffix} {prefix}$B:1{suffix}", special_tokens=special_tokens
    )


_BYTE_SYMBOLS = bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_SYMBOLS.values())
