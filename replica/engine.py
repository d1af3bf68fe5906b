"""LLMEngine: one replica's synchronous engine. add_request / step / abort_request over the
scheduler, the model runner and the tokenizer; every step returns the token and text deltas
of the requests that advanced, with finish reasons and usage counts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from replica.builtin_model import resolve_model_path
from replica.config import ConfigError, EngineConfig
from replica.model import load_model
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams
from replica.scheduler import Scheduler, SchedulerLoad
from replica.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step added to one request's output."""

    request_id: str
    new_token_ids: list[int]
    text: str  # detokenized delta; concatenated deltas equal the decode of all output tokens
    finish_reason: Optional[str]  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: Optional[list[float]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepStats:
    """Smoothed engine speed, for load reports."""

    step_time_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    steps: int = 0

    def observe(self, elapsed_s: float, num_generated: int, smoothing: float = 0.2) -> None:
        tokens_per_s = num_generated / elapsed_s if elapsed_s > 0 else 0.0
        if self.steps == 0:
            self.step_time_s, self.generation_tokens_per_s = elapsed_s, tokens_per_s
        else:
            self.step_time_s += smoothing * (elapsed_s - self.step_time_s)
            self.generation_tokens_per_s += smoothing * (tokens_per_s - self.generation_tokens_per_s)
        self.steps += 1


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: str = "builtin",
        *,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        attention_backend: str = "auto",
        kv_cache_memory_fraction: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """model: a local Hugging Face directory, or "builtin" for the offline default.
        kv_cache_memory_fraction (GPU only): size the KV pool from this fraction of the free
        device memory after loading the weights, instead of config.num_kv_blocks."""
        model_dir = resolve_model_path(model)
        self.model_name = str(model)
        self.device = torch.device(device) if device else default_device()
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.model, self.model_config = load_model(
            model_dir, dtype=dtype, device=self.device, attention_backend=attention_backend
        )
        if config.max_model_len > self.model_config.max_model_len:
            raise ConfigError(
                f"max_model_len: {config.max_model_len} exceeds the model's {self.model_config.max_model_len}"
            )
        if kv_cache_memory_fraction is not None and self.device.type == "cuda":
            config = self._size_kv_pool(config, kv_cache_memory_fraction)
        self.config = config
        self.eos_token_ids = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.scheduler = Scheduler(config, vocab_size=self.model_config.vocab_size, clock=clock)
        self.runner = ModelRunner(self.model, self.model_config, config.num_kv_blocks, config.block_size, self.device)
        self.clock = clock
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stats = StepStats()
        logger.info("engine ready: model=%s device=%s kv_blocks=%d x %d tokens",
                    self.model_name, self.device, config.num_kv_blocks, config.block_size)

    def _size_kv_pool(self, config: EngineConfig, fraction: float) -> EngineConfig:
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        dtype = next(self.model.parameters()).dtype
        per_block = ModelRunner.kv_cache_bytes_per_block(self.model_config, config.block_size, dtype)
        num_blocks = int(free_bytes * fraction) // per_block
        return EngineConfig(**{**config.model_dump(), "num_kv_blocks": num_blocks})

    # ---- requests --------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        ttft_deadline: Optional[float] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> Request:
        return Request(
            request_id, list(prompt_token_ids), sampling_params, eos_token_ids=self.eos_token_ids,
            arrival_time=self.clock() if arrival_time is None else arrival_time, priority=priority,
            ttft_deadline=ttft_deadline, cache_salt=cache_salt,
        )

    def add_request(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request; raises InvalidRequestError (naming the field) or QueueFullError."""
        self.scheduler.add_request(request)
        if detokenize:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Abort and free the request's KV blocks now."""
        self.detokenizers.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def load(self) -> SchedulerLoad:
        return self.scheduler.load()

    # ---- the step --------------------------------------------------------------------
    def step(self, layer_hook: Optional[Callable[[int], None]] = None) -> list[RequestOutput]:
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output, layer_hook)
        updates = self.scheduler.update(scheduler_output, runner_output.sampled_token_ids)
        outputs = []
        for update in updates:
            request = update.request
            detokenizer = self.detokenizers.get(request.request_id)
            text = ""
            if detokenizer is not None:
                text = detokenizer.add_tokens([update.token_id])
                if update.finished is not None:
                    text += detokenizer.flush()
                    del self.detokenizers[request.request_id]
            logprob = runner_output.logprobs.get(request.request_id)
            outputs.append(RequestOutput(
                request_id=request.request_id,
                new_token_ids=[update.token_id],
                text=text,
                finish_reason=update.finished.finish_reason if update.finished is not None else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_cached_tokens=request.num_cached_tokens,
                logprobs=[logprob] if logprob is not None else None,
            ))
        if not scheduler_output.is_empty:
            self.stats.observe(time.perf_counter() - start, len(updates))
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (offline batch use and tests); returns output token ids."""
        requests = []
        for index, prompt in enumerate(prompts):
            request = self.make_request(f"offline-{index}-{id(prompts)}", prompt, sampling_params)
            self.add_request(request, detokenize=False)
            requests.append(request)
        while self.has_unfinished_requests():
            self.step()
        return [list(r.output_token_ids) for r in requests]
