"""The tokenizer a GGUF file describes in its metadata (llama.cpp's `tokenizer.ggml.*` keys),
rebuilt with the `tokenizers` library as the tokenizer.json + tokenizer_config.json pair a
Hugging Face checkpoint ships: byte-level BPE ("gpt2": SmolLM2, Llama 3) or SentencePiece BPE
("llama": Llama 2, Mistral), vocabulary, merges, special tokens, BOS/EOS.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from replica.model.builtin import bytes_to_unicode
from replica.model.config import ModelLoadError

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
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
SENTENCEPIECE_SPACE = "\u2581"  # "▁", how SentencePiece spells a space inside tokens


class GGUFTokenizerError(ModelLoadError):
    """Tokenizer metadata this module cannot rebuild; the message names the key and value."""


def tokenizer_from_gguf_metadata(metadata: dict[str, Any]) -> Tokenizer:
    """A fast tokenizer equal to the one llama.cpp builds from the same metadata."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {tokenizer_model!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE, SentencePiece BPE)"
        )
    _check_vocabulary(metadata, needs_merges=tokenizer_model == "gpt2")
    if tokenizer_model == "llama":
        return _sentencepiece_tokenizer(metadata)
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
    tokenizer.add_special_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_CONTROL, special=True, byte_level=True))
    tokenizer.add_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_USER_DEFINED, special=False, byte_level=True))
    tokenizer.post_processor = _special_token_template(metadata, tokens)
    return tokenizer


def _check_vocabulary(metadata: dict[str, Any], needs_merges: bool) -> None:
    """GGUFTokenizerError naming the key unless the vocabulary's arrays agree: a token_type or
    scores array shorter than the tokens was cut short silently, a byte-level vocabulary without
    merges tokenized every text byte by byte, a flag given as text read as true (llama.cpp
    refuses all three)."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(token, str) for token in tokens):
        raise GGUFTokenizerError("tokenizer.ggml.tokens: missing, or not a list of strings")
    for key, kinds in (("tokenizer.ggml.token_type", (int,)), ("tokenizer.ggml.scores", (int, float))):
        values = metadata.get(key)
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)
                                   or not all(isinstance(value, kinds) and not isinstance(value, bool)
                                              for value in values)):
            length = len(values) if isinstance(values, list) else type(values).__name__
            raise GGUFTokenizerError(f"{key}: {length} values for {len(tokens)} tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if needs_merges and (not isinstance(merges, list) or not merges):
        raise GGUFTokenizerError("tokenizer.ggml.merges: a byte-level BPE vocabulary needs its merges")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        if key in metadata and not isinstance(metadata[key], bool):
            raise GGUFTokenizerError(f"{key}: {metadata[key]!r} is not a boolean")


def _sentencepiece_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE as Hugging Face's Llama tokenizer runs it: "▁" for spaces (one prepended
    to the text), unknown characters as their UTF-8 byte tokens, merges by the merged token's score."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SENTENCEPIECE_SPACE, prepend_scheme="first" if add_prefix_space else "never", split=False)
    steps = [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))  # the space the pre-tokenizer prepended
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_CONTROL, special=True))
    tokenizer.add_tokens(_added_tokens(tokens, token_types, TOKEN_TYPE_USER_DEFINED, special=False))
    tokenizer.post_processor = _special_token_template(metadata, tokens)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best merged token first (transformers' generate_merges, so both build the same tokenizer)."""
    merges = []
    for merged, score in scores.items():
        splits = [(merged[:cut], merged[cut:], score) for cut in range(1, len(merged))
                  if merged[:cut] in vocab and merged[cut:] in vocab]
        merges.extend(sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


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
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default)) and "tokenizer.ggml.bos_token_id" in metadata


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


def _added_tokens(tokens: list[str], token_types: list[int], wanted_type: int, *, special: bool,
                  byte_level: bool = False) -> list[AddedToken]:
    # In a byte-level vocabulary a control token outside the byte alphabet cannot be real (a
    # llama.cpp mislabel); adding it would grow the vocabulary past the model's, so it is left out.
    return [
        AddedToken(token, special=special, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == wanted_type and (not byte_level or set(token) <= _BYTE_ALPHABET)
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
