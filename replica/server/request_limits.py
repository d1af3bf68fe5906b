"""Limits on what one client request may bring in, checked where it enters before any work
is spent on it (request bytes, prompt characters), and tokenization of long prompts on a
worker thread, so one large request never stalls the event loop the others share.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from replica.core.request import check_text
from replica.errors import InvalidRequestError
from replica.text.tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gRPC's own default receive limit
# Far beyond what any context holds (~4 characters per token), small enough to tokenize in
# about a second of one core.
DEFAULT_MAX_PROMPT_CHARS = 1024 * 1024
# Shorter prompts tokenize in well under a millisecond: a thread hop would cost more.
INLINE_TOKENIZE_MAX_CHARS = 4096


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS

    def check_request_bytes(self, num_bytes: int, field_name: str = "request") -> None:
        if num_bytes > self.max_request_bytes:
            raise InvalidRequestError(
                field_name, f"{num_bytes} bytes exceeds the limit of {self.max_request_bytes} bytes"
            )

    def check_prompt_text(self, field_name: str, text: str) -> None:
        """A prompt text too long to tokenize here, or not valid Unicode, fails naming `field_name`."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                field_name, f"{len(text)} characters exceeds the limit of {self.max_prompt_chars} characters"
            )
        check_text(field_name, text)


async def encode_prompt(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, limits: RequestLimits,
                        field_name: str) -> list[int]:
    """The prompt's token ids, checked against `limits` first; long texts are tokenized on a
    worker thread (Tokenizer.encode releases the GIL), short ones inline."""
    limits.check_prompt_text(field_name, text)
    if len(text) <= INLINE_TOKENIZE_MAX_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
