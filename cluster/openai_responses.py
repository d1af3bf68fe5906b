"""The OpenAI-compatible HTTP API's responses: completion and chat bodies, SSE chunks (never an
empty delta mid-stream), log-probabilities in each API's own shape (an echoed prompt's in the
completion's, vLLM's prompt_logprobs in its own), usage over every choice, and best_of's choice
of the n most likely candidates.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Callable, Iterator, Literal, Optional

from replica.core.outputs import PromptLogprobs, RequestOutput
from cluster.openai_structured import ToolCalling
from cluster.tool_parsers import ToolCallOutput

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -inf; vLLM reports log-probabilities below this as this.
MIN_LOGPROB = -9999.0


# JSON as SSE events and FastAPI's responses write it, encoded in pure Python (iterencode) for a
# large body a worker thread renders: json's C encoder holds the GIL, and so the event loop,
# through a whole body (0.2 s for a 6,000-token prompt's logprobs with 20 alternatives, echoed and
# in vLLM's field), where this lets the loop run between pieces (and takes half the time of
# FastAPI's jsonable_encoder and dumps). The pieces are joined (and a response's made UTF-8) this
# many at a time: one join of millions of them, or one encode of the whole text, held it ~50 ms.
_SSE_JSON = json.JSONEncoder(separators=(",", ":"))
_RESPONSE_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_JOINED_PIECES = 1 << 16


def _in_pieces(encoder: json.JSONEncoder, body: dict[str, Any]) -> Iterator[str]:
    pieces = encoder.iterencode(body)
    return iter(lambda: "".join(islice(pieces, _JOINED_PIECES)), "")


def sse(body: dict[str, Any], in_pieces: bool = False) -> str:
    """An SSE event of `body`; `in_pieces` (on a worker thread): encoded as above (ASCII, as
    json.dumps writes it: the stream makes it bytes on the loop, a copy)."""
    text = "".join(_in_pieces(_SSE_JSON, body)) if in_pieces else json.dumps(body, separators=(",", ":"))
    return f"data: {text}\n\n"


def response_json_in_pieces(body: dict[str, Any]) -> bytes:
    """A response body's JSON, as FastAPI renders it, encoded as above (on a worker thread)."""
    return b"".join(text.encode() for text in _in_pieces(_RESPONSE_JSON, body))


class TokenText:
    """Token id -> the text a logprobs entry shows for it (special tokens included), and the
    bytes it adds to the output (`bytes_of`), cached: a vocabulary is small and the same
    tokens recur."""

    def __init__(self, decode: Callable[[list[int]], str], token_bytes: Optional[Callable[[int], bytes]] = None):
        self._decode = decode
        self._token_bytes = token_bytes
        self._cache: dict[int, str] = {}
        self._bytes_cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text

    def bytes_of(self, token_id: int) -> list[int]:
        """OpenAI's `bytes`: what a client joins to rebuild the text. A token that is part of
        a UTF-8 character has its own bytes, not its text's U+FFFD (three other bytes)."""
        value = self._bytes_cache.get(token_id)
        if value is None:
            raw = self._token_bytes(token_id) if self._token_bytes is not None else self(token_id).encode("utf-8")
            value = self._bytes_cache[token_id] = list(raw)
        return value


@dataclass
class ChoiceResult:
    """What one choice has generated so far."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[str | int] = None
    last: Optional[RequestOutput] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # when asked for: with the first output

    def add(self, chunk: RequestOutput) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.text += chunk.text
        self.token_ids.extend(chunk.new_token_ids)
        self.logprobs.extend(chunk.logprobs or ())
        self.top_logprobs.extend((list(top.token_ids), list(top.logprobs)) for top in chunk.top_logprobs or ())
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        self.last = chunk

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


def without_generation(output: RequestOutput) -> RequestOutput:
    """An output of an echo-only completion (max_tokens 0): the one token the engine generated
    for it (vLLM's way too) never shows; the choice ends as "length", with no tokens."""
    return replace(output, new_token_ids=[], text="", num_output_tokens=0, logprobs=None, top_logprobs=None,
                   finish_reason="length" if output.finish_reason is not None else None, stop_reason=None)


def best_choices(results: list[ChoiceResult], num_candidates: int, n: int) -> list[ChoiceResult]:
    """best_of: per prompt, the n candidates with the highest cumulative log-probability (as
    vLLM ranked them), re-indexed prompt_index * n + rank."""
    if num_candidates == n:
        return results
    chosen = []
    for prompt_index in sorted({result.prompt_index for result in results}):
        candidates = [result for result in results if result.prompt_index == prompt_index]
        ranked = sorted(candidates, key=lambda result: result.cumulative_logprob, reverse=True)[:n]
        for rank, result in enumerate(ranked):
            result.index = prompt_index * n + rank
            chosen.append(result)
    return chosen


def usage(results: list[ChoiceResult]) -> dict[str, Any]:
    """Prompt tokens once per prompt, completion tokens over every generated sequence."""
    first_of_prompt = {result.prompt_index: result.last for result in reversed(results) if result.last is not None}
    prompt_tokens = sum(last.num_prompt_tokens for last in first_of_prompt.values())
    completion_tokens = sum(result.last.num_output_tokens for result in results if result.last is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(last.num_cached_tokens for last in first_of_prompt.values())},
    }


class CompletionBodies:
    """Response bodies of one /v1/completions or /v1/chat/completions request.

    num_logprobs: None when the client asked for no log-probabilities, else the number of
    alternatives per token. echo_texts: per prompt, text that opens each of its choices.
    tool_calling: a chat request's tools, whose calls its choices' text becomes.
    prompt_token_ids: per prompt, its tokens, where its log-probabilities are shown: opening a
    completion's logprobs (`echo_logprobs`, with num_logprobs alternatives), and as vLLM's
    `prompt_logprobs` field when the client asked for that (`prompt_logprobs_field`: its count
    of alternatives)."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model_id: str, token_text: TokenText,
                 num_logprobs: Optional[int], echo_texts: list[str], tool_calling: Optional[ToolCalling] = None,
                 prompt_token_ids: Optional[list[list[int]]] = None, echo_logprobs: bool = False,
                 prompt_logprobs_field: Optional[int] = None):
        self.chat = kind == "chat"
        self.request_id = request_id
        self.model_id = model_id
        self.token_text = token_text
        self.num_logprobs = num_logprobs
        self.echo_texts = echo_texts
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}  # completions: text_offset of each choice's next token
        self._pending: dict[int, ChoiceResult] = {}  # streamed tokens whose text is not out yet
        self.tool_calling = tool_calling
        self._tool_outputs: dict[int, ToolCallOutput] = {}  # per streamed choice, with tools
        # Per streamed choice with tools: engine outputs whose text is not settled yet (the end
        # of their text in the choice's, and the output), and tokens settled but not yet sent.
        self._unsettled: dict[int, list[tuple[int, RequestOutput]]] = {}
        self._settled: dict[int, ChoiceResult] = {}
        self.prompt_token_ids = prompt_token_ids
        self.echo_logprobs = echo_logprobs  # completions only: the caller says so for chat
        self.prompt_logprobs_field = prompt_logprobs_field
        self._echoed: set[int] = set()  # streamed completions with echo_logprobs whose prompt is out

    def prompt_logprob_entries(self, prompt_index: int) -> int:
        """Entries (a token with its alternatives) that a choice of this prompt shows its prompt's
        log-probabilities in: the echoed ones and vLLM's field (a chat body's one field counted
        with each of its choices: an upper bound), what building its body costs beyond its
        generated tokens'."""
        per_token = ((self.num_logprobs + 1 if self.echo_logprobs else 0)
                     + (self.prompt_logprobs_field + 1 if self.prompt_logprobs_field is not None else 0))
        return per_token and per_token * len(self.prompt_token_ids[prompt_index])

    def opens_with_prompt(self, index: int) -> bool:
        """Whether streamed choice `index`'s next chunk opens with its prompt's logprobs (echo)."""
        return self.echo_logprobs and index not in self._echoed

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_id}

    # ---- streaming ----------------------------------------------------------------------
    def first_chunks(self, choice_indices: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """Chat streams announce the assistant's role (and echoed text) before any content,
        as OpenAI's do; completions with echo send the prompt text first."""
        chunks = []
        for index, prompt_index in choice_indices:
            echo = self.echo_texts[prompt_index]
            if self.chat:
                delta = {"role": "assistant", "content": echo}
                chunks.append(self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}))
            elif echo and not self.echo_logprobs:  # else the prompt opens the choice's first chunk, with its logprobs
                self._text_offsets[index] = len(echo)
                chunks.append(self._chunk({"index": index, "text": echo, "logprobs": None, "finish_reason": None}))
        return chunks

    def chunk(self, index: int, prompt_index: int, chunk: RequestOutput) -> Optional[dict[str, Any]]:
        """The SSE body for one engine output of choice `index`, or None when it carries
        nothing to show yet (its tokens' text is held back: they go out with the next one)."""
        if self.chat and self.tool_calling is not None:
            return self._tool_chunk(index, prompt_index, chunk)
        pending = self._pending.setdefault(index, ChoiceResult(index, prompt_index))
        pending.add(chunk)
        if not chunk.text and chunk.finish_reason is None:
            return None
        del self._pending[index]
        text = chunk.text
        echoes = self.opens_with_prompt(index)
        if echoes:  # the choice's first chunk: the prompt and its logprobs open it
            self._echoed.add(index)
            text = self.echo_texts[prompt_index] + text
        text_offset = self._text_offsets.get(index, 0)
        logprobs = self._logprobs(pending, text_offset, echoes)
        if not self.chat:
            shown = (self.prompt_token_ids[prompt_index] if echoes else []) + pending.token_ids
            self._text_offsets[index] = text_offset + sum(len(self.token_text(token_id)) for token_id in shown)
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
        choice.update(finish_reason=chunk.finish_reason, stop_reason=chunk.stop_reason)
        return self._chunk(choice)

    def _tool_chunk(self, index: int, prompt_index: int, chunk: RequestOutput) -> Optional[dict[str, Any]]:
        """A chat choice with tools: content and tool-call deltas as the parser releases them.
        Each output's logprobs go out with the first chunk sent once all its text is settled
        (sent as content, read into a call, or dropped as the calls' syntax), so text held
        back as a possible call and then released as content keeps its logprobs, and the
        tokens of a call carry theirs in its deltas (as vLLM's do)."""
        output = self._tool_outputs.get(index)
        if output is None:
            output = self._tool_outputs[index] = ToolCallOutput(self.tool_calling)
        unsettled = self._unsettled.setdefault(index, [])
        unsettled.append((len(output.text) + len(chunk.text), chunk))
        content, tool_calls, finish_reason = output.feed(chunk.text, chunk.finish_reason)
        settled = self._settled.setdefault(index, ChoiceResult(index, prompt_index))
        while unsettled and unsettled[0][0] <= output.decided:
            settled.add(unsettled.pop(0)[1])
        delta: dict[str, Any] = {"content": content} if content else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if not delta and finish_reason is None:
            return None  # held back: it may be part of a tool call
        del self._settled[index]
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(settled, 0),
                  "finish_reason": finish_reason, "stop_reason": chunk.stop_reason}
        return self._chunk(choice)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self._chunk_object), "choices": [choice]}

    def usage_chunk(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return {**self._envelope(self._chunk_object), "choices": [], "usage": usage(results)}

    # ---- whole responses ----------------------------------------------------------------
    def response(self, results: list[ChoiceResult], chosen: list[ChoiceResult]) -> dict[str, Any]:
        """`chosen` the choices returned (best_of may drop some), `results` every one generated."""
        choices = []
        for result in sorted(chosen, key=lambda result: result.index):
            echo = self.echo_texts[result.prompt_index]
            logprobs = self._logprobs(result, 0 if self.echo_logprobs else len(echo), self.echo_logprobs)
            finish_reason = result.finish_reason
            if self.chat:
                message = {"role": "assistant", "content": echo + result.text}
                if self.tool_calling is not None:
                    message, finish_reason = ToolCallOutput(self.tool_calling).message(result.text, finish_reason)
                    if echo:  # opens the content, as the stream's first chunk sends it
                        message["content"] = echo + (message["content"] or "")
                choice = {"index": result.index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": result.index, "text": echo + result.text, "logprobs": logprobs}
            choice.update(finish_reason=finish_reason, stop_reason=result.stop_reason)
            if self.prompt_logprobs_field is not None and not self.chat:  # vLLM's: on each completion choice
                choice["prompt_logprobs"] = self._prompt_logprobs(result)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        body = {**self._envelope(obj), "choices": choices, "usage": usage(results)}
        if self.prompt_logprobs_field is not None and self.chat:  # vLLM's: once, beside the choices (one prompt)
            body["prompt_logprobs"] = self._prompt_logprobs(results[0])
        return body

    # ---- log-probabilities --------------------------------------------------------------
    def _logprobs(self, result: ChoiceResult, text_offset: int, with_prompt: bool = False) -> Optional[dict[str, Any]]:
        """with_prompt: a completion's logprobs open with its prompt's (echo with logprobs)."""
        if self.num_logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(token_id, logprob, top) for token_id, logprob, top
                                in zip(result.token_ids, result.logprobs, self._tops(result))]}
        if not with_prompt:
            return self._completion_logprobs(result.token_ids, result.logprobs, self._tops(result), text_offset)
        prompt_token_ids, gathered = self.prompt_token_ids[result.prompt_index], result.prompt_logprobs
        # The first token has no context: null, as OpenAI's and vLLM's legacy completions show it.
        tops = [(top.token_ids[:self.num_logprobs], top.logprobs[:self.num_logprobs]) for top in gathered.top or ()]
        prompt = self._completion_logprobs(prompt_token_ids, [None] + gathered.logprobs,
                                           [None] + (tops or [([], [])] * len(gathered.logprobs)), text_offset)
        text_offset += sum(map(len, prompt["tokens"]))
        generated = self._completion_logprobs(result.token_ids, result.logprobs, self._tops(result), text_offset)
        return {key: prompt[key] + generated[key] for key in prompt}

    def _prompt_logprobs(self, result: ChoiceResult) -> list[Optional[dict[str, dict[str, Any]]]]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, then by token id the
        token's and its most likely alternatives' logprob, rank and text."""
        prompt_token_ids, gathered = self.prompt_token_ids[result.prompt_index], result.prompt_logprobs
        entries: list[Optional[dict[str, dict[str, Any]]]] = [None]
        for position, (token_id, logprob, rank) in enumerate(zip(prompt_token_ids[1:], gathered.logprobs,
                                                                  gathered.ranks)):
            entry = {str(token_id): self._vllm_logprob(token_id, logprob, rank)}
            if gathered.top is not None:
                top = gathered.top[position]
                alternatives = zip(top.token_ids[:self.prompt_logprobs_field], top.logprobs[:self.prompt_logprobs_field])
                for top_rank, (top_id, top_logprob) in enumerate(alternatives, start=1):
                    entry.setdefault(str(top_id), self._vllm_logprob(top_id, top_logprob, top_rank))
            entries.append(entry)
        return entries

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": self.token_text(token_id)}

    def _tops(self, result: ChoiceResult) -> list[tuple[list[int], list[float]]]:
        return result.top_logprobs or [([], [])] * len(result.token_ids)

    def _chat_logprob(self, token_id: int, logprob: float, top: tuple[list[int], list[float]]) -> dict[str, Any]:
        entry = self._token_entry(token_id, logprob)
        entry["top_logprobs"] = [self._token_entry(top_id, top_logprob) for top_id, top_logprob in zip(*top)]
        return entry

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token_text(token_id)
        return {"token": token, "logprob": max(logprob, MIN_LOGPROB), "bytes": self.token_text.bytes_of(token_id)}

    def _completion_logprobs(self, token_ids: list[int], token_logprobs: list[Optional[float]],
                             tops: list[Optional[tuple[list[int], list[float]]]], text_offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object of these tokens; a None logprob (a prompt's first
        token) shows as null, in token_logprobs and top_logprobs."""
        tokens, offsets, top_dicts = [], [], []
        for token_id, logprob, top_entry in zip(token_ids, token_logprobs, tops):
            token = self.token_text(token_id)
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            if logprob is None:
                top_dicts.append(None)
                continue
            top_ids, top_values = top_entry
            # OpenAI: the top alternatives, and always the sampled token too, with its own
            # logprob: assigned last, over an alternative whose text is the same (the bytes of a
            # partial character all show as U+FFFD), so that it agrees with token_logprobs.
            top = {self.token_text(top_id): max(value, MIN_LOGPROB) for top_id, value in zip(top_ids, top_values)}
            top[token] = max(logprob, MIN_LOGPROB)
            top_dicts.append(top)
        return {"tokens": tokens,
                "token_logprobs": [None if value is None else max(value, MIN_LOGPROB) for value in token_logprobs],
                "top_logprobs": top_dicts, "text_offset": offsets}
