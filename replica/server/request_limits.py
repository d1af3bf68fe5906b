"""Limits on what one client request may bring in, checked where it enters before any work
is spent on it (request bytes, prompt characters, its id, its stop strings), and tokenization
of long prompts on a worker thread, so one large request never stalls the event loop the
others share.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from replica.core.request import check_text
from replica.errors import InvalidRequestError
from replica.text.tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gRPC's own default receive limit
# The least a gRPC server of ours takes in as it arrives (RequestLimits.message_cap).
MIN_MESSAGE_CAP = 32 * 1024 * 1024
# How far past max_request_bytes a replica's own gRPC server still parses a message, so that
# one near the bound is refused naming `request` (RequestLimits.receive_cap).
RECEIVE_SLACK_BYTES = 1024 * 1024
# Far beyond what any context holds (~4 characters per token), small enough to tokenize in
# about a second of one core.
DEFAULT_MAX_PROMPT_CHARS = 1024 * 1024
# Shorter prompts tokenize in well under a millisecond: a thread hop would cost more.
INLINE_TOKENIZE_MAX_CHARS = 4096
# A request id rides in every message of its stream, in every step's output the engine core
# sends the front and in every response: a 3 MB id slowed every other stream of the replica by
# a third. Far beyond a UUID, a trace id or the ingress's "chatcmpl-<32 hex>-<n>".
DEFAULT_MAX_REQUEST_ID_CHARS = 256
# Stop strings are matched on the front's event loop, which every stream shares, after every
# token of the request, at a cost that grows with their number and total length: 3,000 stop
# strings of 300 characters held every other stream for seconds at a time. OpenAI takes 4.
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# stop_token_ids are looked up after every token in the engine core's step loop, and every
# logit_bias entry is gathered on the host for every step the request is in: a request must not
# slow the steps of all the others it is batched with (a 4 MB request holds ~300,000 of either).
DEFAULT_MAX_STOP_TOKEN_IDS = 1024
DEFAULT_MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_request_id_chars: int = DEFAULT_MAX_REQUEST_ID_CHARS
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS

    def message_cap(self) -> int:
        """What gRPC itself refuses as it arrives (RESOURCE_EXHAUSTED), set on every gRPC server
        of ours (the replica's, Serve's proxy): well past max_request_bytes, so a message near
        it still gets INVALID_ARGUMENT naming `request` (at gRPC's default of 4 MiB, the default
        bound itself, the check never ran and a larger bound was unreachable). It bounds a
        server's responses too: a Tokenize reply of max_prompt_chars characters (at most 4
        tokens of at most 4 bytes each per character) fits."""
        return max(4 * self.max_request_bytes, 16 * self.max_prompt_chars, MIN_MESSAGE_CAP)

    def receive_cap(self) -> int:
        """What a replica's own gRPC server parses as it arrives, larger messages refused by
        gRPC (RESOURCE_EXHAUSTED) unread: max_request_bytes and a little (message_cap bounds
        what Serve's proxy sends as well, and sized it: a 30 MiB message was parsed on the
        replica's event loop, stalling every stream 1.7 s, before the bound refused it)."""
        return min(self.max_request_bytes + RECEIVE_SLACK_BYTES, self.message_cap())

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

    def check_request_id(self, request_id: str, field_name: str = "request_id") -> None:
        if len(request_id) > self.max_request_id_chars:
            raise InvalidRequestError(
                field_name, f"{len(request_id)} characters exceeds the limit of {self.max_request_id_chars} characters"
            )

    def check_token_lists(self, num_stop_token_ids: int, num_logit_bias: int) -> None:
        """Per-token work a request brings to every step it is in (engine field names, reported
        as sampling.stop_token_ids and sampling.logit_bias by the gRPC edges)."""
        if num_stop_token_ids > self.max_stop_token_ids:
            raise InvalidRequestError("stop_token_ids", f"{num_stop_token_ids} token ids exceeds the limit of "
                                                        f"{self.max_stop_token_ids}")
        if num_logit_bias > self.max_logit_bias:
            raise InvalidRequestError("logit_bias", f"{num_logit_bias} entries exceeds the limit of {self.max_logit_bias}")

    def check_stop(self, stop: Sequence[str], field_name: str = "stop") -> None:
        """Stop strings too many or too long to match after every token (the engine's field
        name by default: the gRPC edges report it as sampling.stop)."""
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(field_name, f"{len(stop)} stop strings exceeds the limit of {self.max_stop_strings}")
        total = sum(len(string) for string in stop)
        if total > self.max_stop_chars:
            raise InvalidRequestError(
                field_name, f"{total} characters in all exceeds the limit of {self.max_stop_chars} characters"
            )


async def encode_prompt(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, limits: RequestLimits,
                        field_name: str) -> list[int]:
    """The prompt's token ids, checked against `limits` first; long texts are tokenized on a
    worker thread (Tokenizer.encode releases the GIL), short ones inline."""
    limits.check_prompt_text(field_name, text)
    if len(text) <= INLINE_TOKENIZE_MAX_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
