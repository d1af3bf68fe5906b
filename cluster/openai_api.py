"""The OpenAI-compatible HTTP API's requests: body parsing with errors in OpenAI's shape that
name the parameter, the /v1/completions and /v1/chat/completions bodies (OpenAI's fields and
vLLM's sampling and chat template extensions, with vLLM's meanings) and vLLM's /tokenize and
/detokenize bodies, and what each choice asks of the engine.
Structured output and tool calling parameters become one engine constraint
(cluster/openai_structured.py). A parameter the engine cannot honour (images, audio, ...) is
refused by name, never silently ignored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from cluster.openai_structured import OutputConstraint, StructuredOutputFields, ToolFields
from replica.core.structured_output import MAX_JSON_DEPTH, StructuredOutput, loads_json, nested_deeper_than

from replica.config import NumbersNotBooleans
from replica.core.request import MAX_TOP_LOGPROBS, SamplingDefaults, SamplingParams
from replica.errors import HeadroomError, InvalidRequestError
from replica.text.tokenizer import RESERVED_TEMPLATE_VARIABLES

if TYPE_CHECKING:
    from replica.server.request_limits import RequestLimits

logger = logging.getLogger(__name__)

# Names an OpenAI or vLLM client may send that this server cannot honour, each with the
# test for a value that asks for something (None, False, "" and the defaults do not).
_ASKS = lambda value: value not in (None, False, "", [], {})  # noqa: E731
UNSUPPORTED_PARAMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_ASKS, "the deprecated functions are not supported; use tools"),
    "function_call": (lambda value: value not in (None, "none"), "the deprecated function_call is not supported; "
                                                                 "use tool_choice"),
    "audio": (_ASKS, "audio output is not supported"),
    "modalities": (lambda value: value not in (None, ["text"]), "only the text modality is supported"),
    "prediction": (_ASKS, "predicted outputs are not supported"),
    "web_search_options": (_ASKS, "web search is not supported"),
    "reasoning_effort": (_ASKS, "reasoning effort is not supported by this model"),
    "suffix": (_ASKS, "suffix (insertion) is not supported"),
    "min_tokens": (lambda value: value not in (None, 0), "min_tokens is not supported"),
    "use_beam_search": (_ASKS, "beam search is not supported"),
    "length_penalty": (lambda value: value not in (None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "allowed_token_ids": (_ASKS, "allowed_token_ids is not supported"),
    "bad_words": (_ASKS, "bad_words is not supported"),
    "truncate_prompt_tokens": (_ASKS, "prompt truncation is not supported"),
    "spaces_between_special_tokens": (lambda value: value is False, "not configurable"),
    "structural_tag": (_ASKS, "structural tags are not supported; use a JSON schema, regex, choice or grammar"),
    "logits_processors": (_ASKS, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (_ASKS, "not supported"),
    "cache_salt": (_ASKS, "cache_salt is not supported"),
    "chat_template": (_ASKS, "the server's chat template is always used (the model's, or headroom serve "
                             "--chat-template)"),
    "documents": (_ASKS, "documents (RAG templates) are not supported"),
    "mm_processor_kwargs": (_ASKS, "multimodal input is not supported"),
    "kv_transfer_params": (_ASKS, "KV transfer is not supported"),
    # Chat's fields (ToolFields), so these reach this table only on /v1/completions.
    "tools": (_ASKS, "tool calling needs /v1/chat/completions"),
    "tool_choice": (lambda value: value not in (None, "none"), "tool calling needs /v1/chat/completions"),
}


def refuse_unsupported(extra: Optional[dict[str, Any]]) -> None:
    """Raise InvalidRequestError naming the first of a body's extra keys that asks for something
    in UNSUPPORTED_PARAMS."""
    for name, value in (extra or {}).items():
        if name in UNSUPPORTED_PARAMS:
            asks, reason = UNSUPPORTED_PARAMS[name]
            if asks(value):
                raise InvalidRequestError(name, reason)


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, param, code, error_type)


def error_body(message: str, param: Optional[str], code: Optional[str] = None,
               error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request_body(error: InvalidRequestError, param_for_field: dict[str, str]) -> dict[str, Any]:
    """An engine-side field error as OpenAI's error, `param` being the request body's field."""
    param = param_for_field.get(error.field, error.field)
    if error.openai_code is not None:
        # An error OpenAI's API codes (context_length_exceeded) in its own words, which clients
        # match on: the message as it is, `param` naming the field.
        return error_body(error.message, param, error.openai_code)
    return error_body(f"{param}: {error.message}", param)


def openai_error(error: BaseException, param_for_field: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body `error` ends a request with: the status, type and
    code each headroom error declares (replica/errors.py); anything undeclared is a 500."""
    if isinstance(error, InvalidRequestError):
        return 400, invalid_request_body(error, param_for_field)
    if isinstance(error, HeadroomError):
        return error.http_status, error_body(error.client_message, None, error.openai_code, error.openai_type)
    logger.error("request failed", exc_info=error)
    return 500, error_body(f"internal error: {error}", None, "internal_error", "server_error")


def parse_body(raw: bytes, model: type[BaseModel], limits: Optional[RequestLimits] = None) -> BaseModel:
    """The request body as `model`; raises OpenAIError (400) naming the parameter at fault.
    `limits`: the per-token lists' bounds, checked on the parsed JSON before the model
    validates it (pydantic holds the GIL through a list of a million ids: the event loop too,
    though a large body is parsed on a worker thread)."""
    try:
        document = json.loads(raw)  # detects UTF-8/16/32 as JSON allows; fails on other bytes
    except UnicodeDecodeError as error:
        raise OpenAIError(400, f"body: not UTF-8 encoded JSON (byte {error.start} is invalid)") from None
    except json.JSONDecodeError as error:
        raise OpenAIError(400, f"body: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    except RecursionError:  # json's own limit, near 1,000 levels: no JSONDecodeError
        raise OpenAIError(400, f"body: nested more than {MAX_JSON_DEPTH} levels deep") from None
    if nested_deeper_than(document, MAX_JSON_DEPTH):
        raise OpenAIError(400, f"body: nested more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(document, dict):
        raise OpenAIError(400, f"body: expected a JSON object, got {type(document).__name__}")
    if limits is not None:
        _check_list_sizes(document, limits)
    try:
        return model.model_validate(document)
    except ValidationError as error:
        errors = [(body_loc(item["loc"], document, item["type"] == "missing"), item) for item in error.errors()]
        # A value of a union type (guided_json: text or schema; tool_choice: a mode or a
        # function) fails once per member: of the first field's errors, the one that got
        # deepest into the body says best what is wrong (tool_choice.function: Field required).
        first_loc = errors[0][0]
        loc, first = max((entry for entry in errors if entry[0][:len(first_loc)] == first_loc),
                         key=lambda entry: len(entry[0]))
        param = param_path(loc) or None
        # Each member's complaint about the value, once: "a valid string; or a valid dictionary".
        messages = dict.fromkeys(item["msg"].removeprefix("Value error, ") for item_loc, item in errors
                                 if item_loc == loc)
        message = "; or ".join(messages) if first["type"] != "missing" else first["msg"]
        raise OpenAIError(400, f"{param or 'body'}: {message}", param) from None


def _check_list_sizes(document: dict[str, Any], limits: RequestLimits) -> None:
    """The bounds (the gRPC edges' too) of the lists whose every entry costs work per token, on
    their raw JSON: a value of another type the model refuses by name anyway."""
    stop, stop_token_ids, logit_bias = (document.get(name) for name in ("stop", "stop_token_ids", "logit_bias"))
    stop = [stop] if isinstance(stop, str) else stop
    try:
        limits.check_token_lists(len(stop_token_ids) if isinstance(stop_token_ids, list) else 0,
                                 len(logit_bias) if isinstance(logit_bias, dict) else 0)
        if isinstance(stop, list) and all(isinstance(string, str) for string in stop):
            limits.check_stop(stop)
    except InvalidRequestError as error:
        raise OpenAIError(400, str(error), error.field) from None


def body_loc(loc: tuple[Union[str, int], ...], document: Any, missing: bool) -> tuple[Union[str, int], ...]:
    """pydantic's error location without what is not in the body: the members of a union
    (`guided_json.str`, `tool_choice.literal['none','auto','required']`) name no parameter.
    A part is kept where the body has it, or as the last of a missing field's location."""
    kept: list[Union[str, int]] = []
    node = document
    for index, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            kept.append(part)
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            kept.append(part)
            node = node[part]
        elif missing and index == len(loc) - 1 and isinstance(node, dict):
            kept.append(part)
    return tuple(kept)


def param_path(loc: tuple[Union[str, int], ...]) -> str:
    """pydantic's error location as the body path a client wrote: `messages[0].content`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far too.
    continuous_usage_stats: StrictBool = False


# Request fields whose null is their default (their types take no None).
NULL_IS_DEFAULT = frozenset({"stream", "echo", "logprobs", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                             "skip_special_tokens", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message"})


class _OpenAIRequest(StructuredOutputFields, NumbersNotBooleans):
    # Extra keys are kept (not validated) so that a parameter this server cannot honour is
    # refused by name (UNSUPPORTED_PARAMS); others are ignored, as vLLM's server does. A boolean
    # for a number (`"max_tokens": true`) is a 400 naming it, as OpenAI's API answers it, not 1;
    # and every boolean is StrictBool, here and in the nested models: anything but true / false
    # (`"stream": "yes"`, which lax parsing read as true) is a 400 naming it.
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None  # vLLM's: unset means the served model
    # null means the default, as in vLLM (OpenAI's clients omit what is unset).
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = Field(1, ge=1)
    best_of: Optional[int] = Field(None, ge=1)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's range, a signed 64-bit integer: 2**64 - 1 was taken too and meant what -1 means.
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 63)
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None  # JSON object keys: token ids as strings
    user: Optional[str] = None
    # vLLM's extensions, under vLLM's names and meanings.
    top_k: Optional[int] = None  # None, 0 or -1: off
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: StrictBool = False
    # false: the text keeps every special token (EOS, control tokens), as vLLM's.
    skip_special_tokens: StrictBool = True
    priority: int = 0  # vLLM's sense, which is the engine's: lower runs first
    # Each prompt token's logprob and this many alternatives, in vLLM's shape (its -1, the whole
    # vocabulary, is past the bound).
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`"stream": null` and the like mean the default, as OpenAI's reference (nullable) and
        vLLM (Optional) take them; they were a 400. Only fields whose null has no meaning of its
        own: a null max_tokens still means "up to the context"."""
        if isinstance(data, dict) and any(data.get(name, False) is None for name in NULL_IS_DEFAULT):
            return {name: value for name, value in data.items() if not (value is None and name in NULL_IS_DEFAULT)}
        return data

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        for key in value:
            if not (isinstance(key, str) and key.lstrip("-").isdigit()):
                raise ValueError(f"key {key!r} is not a token id")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_is_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        raise ValueError(f"must be a string or a list of strings, got {json.dumps(value)[:60]}")

    def check_supported(self, max_choices: int) -> None:
        """Raise InvalidRequestError naming the first parameter this server cannot honour."""
        refuse_unsupported(self.model_extra)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed with stream: true")
        best_of = self.best_of or self.n
        if best_of < self.n:
            raise InvalidRequestError("best_of", f"must be >= n ({self.n}), got {best_of}")
        if best_of > max_choices:
            raise InvalidRequestError("best_of" if self.best_of else "n",
                                      f"{best_of} sequences per prompt exceeds the server's max_num_seqs ({max_choices})")
        if self.stream and best_of > self.n:
            raise InvalidRequestError("best_of", "cannot be streamed when best_of > n: the best are known only at the end")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs", "not available with stream: true (as in vLLM)")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: best_of, of which the n most likely are returned."""
        return self.best_of or self.n

    def output_constraint(self) -> Optional[OutputConstraint]:
        """The one constraint on this request's output, if any; two are refused naming the second."""
        constraints = self.output_constraints()
        if len(constraints) > 1:
            raise InvalidRequestError(constraints[1].param, f"only one output constraint per request; "
                                                            f"{constraints[0].param} is given too")
        return constraints[0] if constraints else None

    @property
    def num_prompt_logprobs(self) -> Optional[int]:
        """Alternatives per prompt token the engine computes, None for no prompt logprobs."""
        return self.prompt_logprobs

    def base_sampling_params(self, max_tokens: int, num_logprobs: Optional[int],
                             structured_output: Optional[StructuredOutput] = None,
                             defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """A null or absent parameter takes `defaults`' value (the model's, as vLLM's server does)."""
        return defaults.sampling_params(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            # best_of ranks candidates by cumulative logprob, so they need theirs.
            logprobs=num_logprobs is not None or self.num_candidates > self.n,
            top_logprobs=num_logprobs or 0,
            prompt_logprobs=self.num_prompt_logprobs,
            stop=self.stop_strings,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            structured_output=structured_output,
        )


def choice_sampling_params(base: SamplingParams, index: int) -> SamplingParams:
    """Candidate `index` of a prompt: vLLM's parallel sampling gives each its own seed. Only
    candidate 0 computes the prompt's log-probabilities (the ingress hands them to the others):
    each would repeat the whole prefill for them, taking no prefix-cache hits."""
    if index == 0 or (base.seed is None and base.prompt_logprobs is None):
        return base
    return replace(base, seed=None if base.seed is None else base.seed + index, prompt_logprobs=None)


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_OpenAIRequest):
    prompt: PromptInput
    max_tokens: Optional[int] = 16  # OpenAI's default for completions; null: up to the context
    echo: StrictBool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: StrictBool = True  # vLLM's: BOS etc. on text prompts

    # "plain": this check is the whole validation. pydantic's own of the union (in Rust, holding
    # the GIL throughout) took 1.6 s for 700,000 token lists; this one yields to the event loop
    # while a large body is parsed on a worker thread.
    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                return value
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return value
            if all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                   for v in value):
                return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists "
                         "(each non-empty)")

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch: one entry per prompt, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt alone comes back (OpenAI's legacy way to score a
        prompt, with logprobs). The engine generates one token, as vLLM's does, that is dropped."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return 1 if self.echo_only else self.max_tokens

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt's tokens open the choices' logprobs, the first with null (vLLM's and
        OpenAI's legacy completions)."""
        return self.echo and self.logprobs is not None

    @property
    def num_prompt_logprobs(self) -> Optional[int]:
        # Enough alternatives for both the echoed prompt's logprobs and vLLM's field, each cut to its own.
        asked = [count for count in (self.prompt_logprobs, self.logprobs if self.echo_logprobs else None)
                 if count is not None]
        return max(asked) if asked else None

    def check_supported(self, max_choices: int) -> None:
        super().check_supported(max_choices)
        # Every sequence is a replica call of its own, made and relayed by the ingress's event
        # loop: 1,000 prompts with n=16 held every other stream for 86 s (and the loop for 6 s)
        # before the replicas' queues refused it. A request may ask for what the n bound
        # allows one prompt: as many sequences as a replica runs at once.
        num_prompts = len(self.prompts)
        if num_prompts > 1 and num_prompts * self.num_candidates > max_choices:
            raise InvalidRequestError("prompt", f"{num_prompts} prompts x {self.num_candidates} sequences each exceeds "
                                                f"the server's max_num_seqs ({max_choices}) sequences per request")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as the API returned it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[AssistantToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template reads it (Hugging Face's form: a call's arguments as
        an object where they parse, as vLLM renders them)."""
        # OpenAI's developer role is its system role renamed (o1 on): chat templates know only
        # "system", and some drop a role they do not know (Qwen2.5: the instructions vanished).
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls
            ]
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _text_content_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part [{index}] is of type {kind!r}: this model takes text parts only")
        return value

    @property
    def text(self) -> str:
        """List-of-parts content joined as vLLM joins it: text parts, newline-separated."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


def _json_or_text(text: str) -> Any:
    try:
        return loads_json(text, "arguments")
    except InvalidRequestError:  # not JSON, or nested too deep for the template to render
        return text


def check_messages(messages: list[ChatMessage]) -> None:
    """Raise InvalidRequestError naming the first message field OpenAI's API would refuse."""
    for index, message in enumerate(messages):
        for name in ("function_call", "audio"):
            if (message.model_extra or {}).get(name):
                raise InvalidRequestError(f"messages[{index}].{name}", "not supported (tool calls are: tool_calls)")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(f"messages[{index}].tool_calls", "only assistant messages hold tool calls")
        # As OpenAI's API: only an assistant's turn may leave out its content (it may be
        # all tool calls), and a tool's result must say which call it answers.
        if message.content is None and message.role != "assistant":
            raise InvalidRequestError(f"messages[{index}].content", f"required in a {message.role} message")
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidRequestError(f"messages[{index}].tool_call_id", "required in a tool message")


class ChatTemplateFields(BaseModel):
    """vLLM's chat body fields for the chat template: the generation prompt (on by default),
    continuing the last (assistant) message instead, and the template's own variables
    (`chat_template_kwargs`, such as Qwen3's `enable_thinking`)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def check_template_fields(self) -> None:
        """Raise InvalidRequestError naming the first template field that cannot be honoured."""
        for name in sorted(self.chat_template_kwargs or ()):
            if name in RESERVED_TEMPLATE_VARIABLES:
                raise InvalidRequestError(f"chat_template_kwargs.{name}", "is a variable the server sets itself (from "
                                                                          "the request's other fields or the model)")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message", "cannot be used with add_generation_prompt true "
                                                                    "(its default): set add_generation_prompt false")
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError("continue_final_message", f"needs an assistant message last to continue, "
                                                                    f"not a {self.messages[-1].role} message")

    def template_options(self) -> dict[str, Any]:
        """Tokenizer.apply_chat_template's keyword arguments for this request."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_OpenAIRequest, ToolFields, ChatTemplateFields):
    # Chat has no fixed default: unset means up to the context length, as in OpenAI's API.
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False  # vLLM's: prepend the last message's content when it is the assistant's

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self, max_choices: int) -> None:
        super().check_supported(max_choices)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs: true")
        check_messages(self.messages)
        self.check_template_fields()
        self.tool_mode()  # a named tool_choice must name a tool

    def output_constraint(self) -> Optional[OutputConstraint]:
        """response_format and the like, or the schema tool_choice required / named imposes."""
        constraint = super().output_constraint()
        tool_constraint = self.tool_constraint()
        if constraint is not None and tool_constraint is not None:
            raise InvalidRequestError(constraint.param, f"cannot constrain the output of a request whose tool_choice "
                                                        f"({self.tool_mode()}) constrains it already")
        return constraint or tool_constraint

    @property
    def echo_text(self) -> str:
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""


@dataclass(frozen=True)
class Choice:
    """One sequence the engine generates for a request: its prompt and sampling params."""

    index: int  # candidate position: prompt_index * num_candidates + candidate
    prompt_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams


class TokenizeRequest(ToolFields, ChatTemplateFields):
    """vLLM's POST /tokenize: a `prompt`, or `messages` rendered through the chat template as
    chat completions renders them (with its tools and template fields)."""

    model_config = ConfigDict(extra="allow")  # as chat's: what cannot be honoured is refused by name

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    # vLLM's defaults: BOS and the like on a prompt; a rendered conversation holds its own.
    add_special_tokens: Optional[StrictBool] = None
    return_token_strs: StrictBool = False

    def check_supported(self) -> None:
        """Raise InvalidRequestError naming the first field this server cannot honour."""
        refuse_unsupported(self.model_extra)
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give either a prompt or messages" + (
                "" if self.prompt is None else ", not both"))
        if self.messages is not None:
            check_messages(self.messages)
            self.check_template_fields()
            if self.add_special_tokens:
                raise InvalidRequestError("add_special_tokens", "not with messages: the rendered conversation holds "
                                                                "the model's special tokens already")


class DetokenizeRequest(NumbersNotBooleans):
    """vLLM's POST /detokenize: token ids back to their text."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]
