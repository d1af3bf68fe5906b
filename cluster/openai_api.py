"""The OpenAI-compatible HTTP API's wire format: request bodies for /v1/completions and
/v1/chat/completions (with vLLM's sampling extensions), response and SSE chunk bodies, and
errors in OpenAI's JSON shape.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from cluster.deployment import GenerationChunk
from replica.request import InvalidRequestError, SamplingParams

SSE_DONE = "data: [DONE]\n\n"


class _OpenAIRequest(BaseModel):
    # OpenAI clients send fields we do not use (user, logit_bias=None, ...): ignore them, as
    # OpenAI's own API does, rather than fail every call from a newer client.
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    # vLLM's extensions, under vLLM's names.
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    priority: int = 0  # vLLM's sense, which is the engine's: lower runs first

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("n", f"only 1 choice per request is supported, got {self.n}")
        if self.stop:
            # The engine stops on token ids; matching strings across detokenized deltas is not built.
            raise InvalidRequestError("stop", "stop strings are not supported; use stop_token_ids")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, list[int]]
    max_tokens: int = 16  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    # Chat has no fixed default: unset means up to the context length, as in OpenAI's API.
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, param: Optional[str], code: Optional[str] = None,
               error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request_body(error: InvalidRequestError, param_for_field: dict[str, str]) -> dict[str, Any]:
    """An engine-side field error as OpenAI's error, `param` being the request body's field."""
    param = param_for_field.get(error.field, error.field)
    return error_body(f"{param}: {str(error).removeprefix(f'{error.field}: ')}", param)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def usage(chunk: GenerationChunk) -> dict[str, Any]:
    return {
        "prompt_tokens": chunk.num_prompt_tokens,
        "completion_tokens": chunk.num_output_tokens,
        "total_tokens": chunk.num_prompt_tokens + chunk.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": chunk.num_cached_tokens},
    }


class CompletionBodies:
    """Response bodies of one /v1/completions or /v1/chat/completions request."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model_id: str):
        self.chat = kind == "chat"
        self.request_id = request_id
        self.model_id = model_id
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_id}

    def first_chunk(self) -> Optional[dict[str, Any]]:
        """Chat streams announce the assistant's role before any content, as OpenAI's do."""
        if not self.chat:
            return None
        return {**self._envelope("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any]:
        if self.chat:
            delta = {"content": chunk.text} if chunk.text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": chunk.finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, last: GenerationChunk) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage(last)}

    def response(self, text: str, last: GenerationChunk) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": last.finish_reason}
            return {**self._envelope("chat.completion"), "choices": [choice], "usage": usage(last)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice], "usage": usage(last)}
