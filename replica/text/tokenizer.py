"""Text <-> token ids for one replica, from the checkpoint's own fast tokenizer on local disk,
its chat template, and the incremental detokenizer that turns a stream of output ids into
text deltas.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders

from replica.text.chat_template import (  # noqa: F401 - resolve_chat_template: the cluster's way in
    RENDERER_VARIABLES, ChatTemplateError, check_chat_templates, find_chat_template, render_chat_template,
    resolve_chat_template, select_chat_template,
)

REPLACEMENT_CHAR = "\ufffd"  # what a decode ends in while a multi-byte character is incomplete
# Tokens an incremental detokenizer holds without releasing text before it stops decoding its
# window at every step (IncrementalDetokenizer.add_tokens): text needs a few at most.
MAX_HELD_TOKENS = 16
# The special tokens a chat template may name, as transformers (5) passes them: its special_tokens_map,
# the named ones only (not the extra special tokens).
_TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The template variables apply_chat_template sets, which a request's own (`template_kwargs`) may not replace.
RESERVED_TEMPLATE_VARIABLES = RENDERER_VARIABLES | {"tools", "documents", *_TEMPLATE_SPECIAL_TOKENS}
# A SentencePiece byte-fallback token: one byte of a character its vocabulary lacks.
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for: printable bytes as
    themselves, the others shifted past 255 (what tokenizers' ByteLevel pre-tokenizer writes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    characters, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + shifted)] = byte
            shifted += 1
    return characters


NO_CHAT_TEMPLATE = ("the model has no chat template (none in its tokenizer_config.json, chat_template.jinja or "
                    "chat_template.json): serve it with --chat-template FILE, or send a completion instead")


class TokenizerLoadError(ValueError):
    """The directory holds no tokenizer we can load; the message names the missing file."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts from tokenizer_config.json."""

    def __init__(self, fast_tokenizer: FastTokenizer, model_dir: Path, tokenizer_config: dict[str, Any],
                 chat_template: Optional[str] = None):
        self._fast_tokenizer = fast_tokenizer
        self._model_dir = model_dir
        self._tokenizer_config = tokenizer_config
        self.bos_token_id = self._special_token_id("bos_token")
        self.eos_token_id = self._special_token_id("eos_token")
        # Some checkpoints (Llama 2, Mistral) ask for BOS in the config rather than in the
        # tokenizer.json post-processor; others put it in both, so add it only when missing.
        self._add_bos_token = bool(tokenizer_config.get("add_bos_token")) and self.bos_token_id is not None
        # A template the server was given (--chat-template) wins over the checkpoint's, as in vLLM:
        # then the checkpoint's is not even read, so a broken one does not stop the model serving.
        # A str, or a checkpoint's named templates ({name: template}).
        self.chat_template: Optional[str | dict[str, str]] = chat_template
        # Why the checkpoint's template cannot be used (unreadable, does not compile), if so:
        # from_pretrained raises it, or (check_chat_template=False) a chat request does.
        self.chat_template_error: Optional[str] = None
        if chat_template is None:
            try:
                self.chat_template = find_chat_template(model_dir, tokenizer_config)
                if self.chat_template is not None:
                    check_chat_templates(self.chat_template)
            except ChatTemplateError as error:
                self.chat_template, self.chat_template_error = None, f"{error}; --chat-template FILE replaces it"
            except (ValueError, LookupError, TypeError, AttributeError, OSError) as error:
                self.chat_template, self.chat_template_error = None, (
                    f"the checkpoint's chat template cannot be read: {type(error).__name__}: {error}; "
                    "--chat-template FILE replaces it")
        self._special_ids: Optional[frozenset[int]] = None  # ids_decode_skips', read at its first call
        self._ids_end = 0
        self._decode_stream_class = None  # decode_stream's: DecodeStream, or False where it does not apply

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: Optional[str] = None, *,
                        check_chat_template: bool = True) -> "Tokenizer":
        """The directory's tokenizer; TokenizerLoadError naming the directory when its files
        (tokenizer.json, tokenizer_config.json, the chat template's) cannot be read as one.
        chat_template: a Jinja chat template to use instead of the checkpoint's (vLLM's
        --chat-template, as chat_template.resolve_chat_template reads it).
        check_chat_template=False: a checkpoint's template that cannot be used is no load
        error, only each chat request's (the engine core, which tokenizes and detokenizes but
        renders no chat a server sends it, and never sees --chat-template)."""
        model_dir = Path(model_dir)
        try:
            tokenizer_config = _read_json_if_present(model_dir / "tokenizer_config.json")
            if not isinstance(tokenizer_config, dict):
                raise ValueError("tokenizer_config.json is not a JSON object")
            # The special tokens special_tokens_map.json names win over tokenizer_config.json's,
            # as transformers (5) reads them, unless the config lists its added tokens
            # (added_tokens_decoder: saved by a newer transformers, its own entries current);
            # then they only fill what it leaves out (transformers ignores the map there).
            special_tokens_map = _read_json_if_present(model_dir / "special_tokens_map.json")
            if isinstance(special_tokens_map, dict):
                special = {name: token for name, token in special_tokens_map.items() if name.endswith("_token")}
                tokenizer_config = ({**special, **tokenizer_config} if "added_tokens_decoder" in tokenizer_config
                                    else {**tokenizer_config, **special})
            tokenizer_json = model_dir / "tokenizer.json"
            if tokenizer_json.is_file():
                tokenizer = cls(FastTokenizer.from_file(str(tokenizer_json)), model_dir, tokenizer_config, chat_template)
            else:
                tokenizer = cls(_fast_tokenizer_via_transformers(model_dir), model_dir, tokenizer_config, chat_template)
            if tokenizer.chat_template_error is not None and check_chat_template:
                raise TokenizerLoadError(f"{model_dir}: {tokenizer.chat_template_error}")
            if chat_template is not None:
                try:
                    check_chat_templates(chat_template)
                except ChatTemplateError as error:
                    raise TokenizerLoadError(f"chat_template: {error}") from None
            return tokenizer
        except TokenizerLoadError:
            raise
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a broken file
            raise TokenizerLoadError(f"{model_dir}: its tokenizer files cannot be read: "
                                     f"{type(error).__name__}: {error}") from None

    @property
    def vocab_size(self) -> int:
        return self._fast_tokenizer.get_vocab_size(with_added_tokens=True)

    def fast_tokenizer_json(self) -> str:
        """The fast tokenizer serialized (tokenizer.json's form): what grammar engines load."""
        return self._fast_tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch calls release the GIL (encode does not), so a long prompt tokenized on a
        # worker thread does not stall the event loop that called it; the fast one skips offsets.
        encode_batch = getattr(self._fast_tokenizer, "encode_batch_fast", self._fast_tokenizer.encode_batch)
        token_ids = encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._add_bos_token and token_ids[:1] != [self.bos_token_id]:
            token_ids.insert(0, self.bos_token_id)
        return token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._fast_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Optional[Callable[[int], Optional[str]]]:
        """tokenizers' own incremental decoder (Rust; vLLM's offsets, as IncrementalDetokenizer's
        window): a step function taking one id and returning the text it releases, or None.

        Offered only for a byte-level decoder (GPT-2's, as Llama 3, Qwen and SmolLM2 use), where
        it releases the window's text exactly; None for others, and where the installed
        tokenizers has no DecodeStream. SentencePiece's byte fallback replaces a broken run of
        bytes as a whole, so there, fed one id at a time, it differed from the window fed a
        step's ids."""
        if self._decode_stream_class is None:  # decided once per tokenizer: the class, or False
            self._decode_stream_class = self.byte_level and getattr(decoders, "DecodeStream", False)
        if not self._decode_stream_class:
            return None
        step = self._decode_stream_class(skip_special_tokens=skip_special_tokens).step
        fast_tokenizer = self._fast_tokenizer
        return lambda token_id: step(fast_tokenizer, token_id)

    @property
    def byte_level(self) -> bool:
        """Whether the decoder is byte-level (GPT-2's): its text is the output's bytes decoded as
        UTF-8, a replacement character per broken sequence (not SentencePiece's byte fallback)."""
        return isinstance(self._fast_tokenizer.decoder, decoders.ByteLevel)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the output (OpenAI's logprobs `bytes`, from which a
        client rebuilds text): a byte-level token's own bytes and a byte-fallback token's byte,
        even when they are part of a UTF-8 character, which the token decoded alone can show only
        as U+FFFD; other tokens' decoded text."""
        token = self._fast_tokenizer.id_to_token(token_id)
        if token is not None and self.byte_level:
            alphabet = _byte_level_alphabet()
            if all(character in alphabet for character in token):
                return bytes(alphabet[character] for character in token)
        elif token is not None and (byte := _BYTE_FALLBACK_TOKEN.fullmatch(token)) is not None:
            return bytes([int(byte.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def ids_decode_skips(self, skip_special_tokens: bool = True) -> tuple[int, frozenset[int]]:
        """The ids `decode` drops before its decoders run, wherever they stand: every id from the
        first returned on (past the vocabulary), and those in the set (the special tokens, when
        skipping them). Leaving them out of any decoded list changes no text."""
        if self._special_ids is None:
            added = self._fast_tokenizer.get_added_tokens_decoder()
            self._special_ids = frozenset(index for index, token in added.items() if token.special)
            # Added tokens may sit past a gap in the ids: the end is after the last of them.
            self._ids_end = max(self.vocab_size, max(added, default=-1) + 1)
        return self._ids_end, self._special_ids if skip_special_tokens else frozenset()

    def token_strings(self, token_ids: Sequence[int]) -> list[Optional[str]]:
        """Each id's token as the vocabulary writes it (`Ġthe`; None for an id past it)."""
        return [self._fast_tokenizer.id_to_token(token_id) for token_id in token_ids]

    def special_token_ids(self, texts: Sequence[str]) -> tuple[int, ...]:
        """The ids of those of `texts` that are special tokens here (decoding skips them)."""
        _, special = self.ids_decode_skips()
        token_ids = (self._fast_tokenizer.token_to_id(text) for text in texts)
        return tuple(token_id for token_id in token_ids if token_id in special)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tools: Optional[Sequence[dict[str, Any]]] = None,
                            *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                            template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The prompt text for a conversation, ending where the assistant's reply begins (or, as
        render_chat_template takes `add_generation_prompt` and `continue_final_message`, where
        the last message's content ends).

        The server's chat template (--chat-template) or else the checkpoint's, rendered as
        transformers does; a conversation it refuses raises ChatTemplateError, and so does a
        model with no template at all (a base model: transformers >= 4.44 and vLLM refuse it
        too, rather than invent a format the model was never trained on). The text already
        holds its special tokens: encode it with add_special_tokens=False.
        tools: the template's `tools` variable (OpenAI's function tools), as transformers passes them.
        template_kwargs: more variables for the template (vLLM's chat_template_kwargs, such as
        Qwen3's `enable_thinking`); one named as a variable set here is a ChatTemplateError.
        """
        if self.chat_template is None:
            raise ChatTemplateError(self.chat_template_error or NO_CHAT_TEMPLATE)
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(template_kwargs or ()))
        if reserved:
            raise ChatTemplateError(f"template variable {reserved[0]!r} is set by the renderer itself")
        template = select_chat_template(self.chat_template, tools=bool(tools))
        # As transformers passes them: `tools` and `documents` always defined, None when not given.
        variables = {**(template_kwargs or {}), **self._template_special_tokens(),
                     "tools": list(tools) if tools else None, "documents": None}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **variables)

    def _template_special_tokens(self) -> dict[str, str]:
        tokens = {name: self._special_token_text(name) for name in _TEMPLATE_SPECIAL_TOKENS}
        return {name: token for name, token in tokens.items() if token is not None}

    def _special_token_id(self, config_key: str) -> Optional[int]:
        token = self._special_token_text(config_key)
        return self._fast_tokenizer.token_to_id(token) if token is not None else None

    def _special_token_text(self, config_key: str) -> Optional[str]:
        token = self._tokenizer_config.get(config_key)
        if isinstance(token, dict):  # serialized AddedToken: {"content": "<s>", ...}
            token = token.get("content")
        return token if isinstance(token, str) else None


def _fast_tokenizer_via_transformers(model_dir: Path) -> FastTokenizer:
    """For checkpoints that ship only slow-tokenizer files (vocab.json + merges.txt, tokenizer.model)."""
    missing = f"{model_dir / 'tokenizer.json'} does not exist"
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise TokenizerLoadError(f"{missing} (and transformers, the fallback loader, is not installed)") from error
    try:
        transformers_tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenizerLoadError(f"{missing} and transformers could not load a tokenizer there: {error}") from error
    fast_tokenizer = getattr(transformers_tokenizer, "backend_tokenizer", None)
    if fast_tokenizer is None:
        raise TokenizerLoadError(f"{missing} and transformers found only a slow tokenizer there")
    return fast_tokenizer


def _read_json_if_present(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class IncrementalDetokenizer:
    """Turns one request's output ids, as they arrive, into text deltas (vLLM's offsets).

    Each step decodes only a short window: the tokens emitted last time (prefix_offset to
    read_offset) for context, plus the new ones. A delta is released once the window's
    text grows and does not end in an incomplete character. The window starts at the
    first output token, so the deltas (ending with flush()) concatenate to exactly
    `tokenizer.decode(output_ids)`; decoding with prompt context would instead keep, for
    example, the leading space a SentencePiece tokenizer strips from the first token. The one
    exception is a SentencePiece tokenizer's byte fallback: a byte arriving later can turn
    text already released into replacement characters in the full decode (_release_settled).

    For a byte-level tokenizer, tokenizers' DecodeStream runs that same window in Rust, a third
    of the cost per token (bench/bench_front.py: 0.6 vs 1.9 µs on prose), fed one id at a time
    while the offsets here follow it (text that completes within a step's ids is released
    then, not at the step's end); the window in Python takes over, for the rest of the request,
    where DecodeStream refuses a step (a decoder that rewrote earlier text, its InvalidPrefix)
    or a run held past MAX_HELD_TOKENS, which DecodeStream would decode whole at every step.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 kept_special_token_ids: Sequence[int] = ()):
        """kept_special_token_ids: special tokens whose text is kept though the others are
        skipped (SamplingParams.kept_special_token_ids)."""
        self._tokenizer = tokenizer
        vocab_end, skipped = tokenizer.ids_decode_skips(skip_special_tokens)
        self._decode_skips = vocab_end, skipped.difference(kept_special_token_ids)
        # The skipped ids never reach the window (add_tokens): decoding it without skipping
        # then shows the kept ones and changes nothing else.
        skip_special_tokens = skip_special_tokens and not kept_special_token_ids
        self._skip_special_tokens = skip_special_tokens
        self._step = tokenizer.decode_stream(skip_special_tokens)  # None: the Python window only
        self._byte_level = tokenizer.byte_level
        self.output_token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._next_look = 0  # past MAX_HELD_TOKENS held: the held count at which to decode again regardless

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """The text the new tokens complete; "" while they end mid-character."""
        vocab_end, skipped = self._decode_skips
        for token_id in new_token_ids:
            if token_id >= vocab_end or token_id in skipped:
                # Ids decode drops (skipped special tokens, ids past the vocabulary) stay out of
                # the window: they change no text, and a window only they grew would never move
                # on, each step decoding it whole (a stream held on a skipped special token by
                # logit_bias and ignore_eos cost the front quadratic time, ~2 s for 8,000 tokens).
                new_token_ids = [token_id for token_id in new_token_ids
                                 if token_id < vocab_end and token_id not in skipped]
                if not new_token_ids:
                    return ""
                break
        step = self._step
        if step is None:
            return self._add_to_window(new_token_ids)
        ids = self.output_token_ids
        text = ""
        for index, token_id in enumerate(new_token_ids):
            ids.append(token_id)
            if len(ids) - self.read_offset > MAX_HELD_TOKENS:
                self._step = None
                return text + self._add_to_window(new_token_ids[index + 1:])
            try:
                released = step(token_id)
            except Exception:  # DecodeStream refused the step: this window's text no longer begins with its prefix's
                self._step = None
                return text + self._add_to_window(new_token_ids[index + 1:])
            if released is not None:
                text += released
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return text

    def _add_to_window(self, new_token_ids: Sequence[int]) -> str:
        self.output_token_ids.extend(new_token_ids)
        held = len(self.output_token_ids) - self.read_offset
        if held > MAX_HELD_TOKENS:
            # Text is held a few tokens at most (the bytes of one character); held this long,
            # the run is bytes that are not text (a byte token forced by logit_bias, a model
            # writing garbage), whose decode ends in a replacement character at every step.
            # Decoding the whole window each step would cost the square of the run, so look
            # again only once it has doubled (as if its tokens had come in larger chunks, the
            # text released is the same), unless the look before released what had settled
            # (_release_settled), which keeps the window short.
            if held < self._next_look:
                return ""
            self._next_look = 2 * held
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            if held > MAX_HELD_TOKENS and self._byte_level:
                return self._release_settled(prefix_text, window_text)
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.output_token_ids)
        self._next_look = 0
        return window_text[len(prefix_text) :]

    def _release_settled(self, prefix_text: str, window_text: str) -> str:
        """A long held run whose decode ends mid-character (or in bytes that are not text):
        release its text up to the last of its few final tokens where the window's decode splits
        cleanly (the decode before it and the decode after it make the whole window's), so that
        what has settled goes out now. Waiting for the whole run to end on a character held a
        model's garbage bytes back for up to twice the run (0.7 s of silence on a stream beside
        a slow request, in tests/cluster/test_outside_clients.py). With a byte-level decoder a
        split inside a character, whole or still incomplete, changes the decode (its bytes
        become replacement characters) and is never taken, so the text released is still
        exactly the full decode. Only there: SentencePiece's byte fallback turns a broken run
        into one replacement character per byte, split or not, and a byte arriving later turns
        the characters of the run it joins into replacement characters too, text released or
        not; such a tokenizer's held runs wait, as does a byte-level run with no clean split
        among its last tokens, looked at again as they double."""
        ids = self.output_token_ids
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        for cut in range(len(ids) - 1, max(self.read_offset, len(ids) - 8), -1):
            part = decode(ids[self.prefix_offset:cut], skip)
            if len(part) > len(prefix_text) and part + decode(ids[cut:], skip) == window_text:
                self.prefix_offset, self.read_offset = self.read_offset, cut
                self._next_look = 0
                return part[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The held-back text, released as-is once the request has finished."""
        prefix_text, window_text = self._decode_window()
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.output_token_ids)
        return window_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        window = self.output_token_ids[self.prefix_offset :]
        num_context_tokens = self.read_offset - self.prefix_offset
        prefix_text = self._tokenizer.decode(window[:num_context_tokens], self._skip_special_tokens)
        window_text = self._tokenizer.decode(window, self._skip_special_tokens)
        return prefix_text, window_text
