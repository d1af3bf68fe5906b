from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_BLOCK_STORED: _ClassVar[KVEventKind]
    KV_EVENT_BLOCK_REMOVED: _ClassVar[KVEventKind]
    KV_EVENT_ALL_BLOCKS_CLEARED: _ClassVar[KVEventKind]

class KVMedium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MEDIUM_DEVICE: _ClassVar[KVMedium]
    KV_MEDIUM_HOST: _ClassVar[KVMedium]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_BLOCK_STORED: KVEventKind
KV_EVENT_BLOCK_REMOVED: KVEventKind
KV_EVENT_ALL_BLOCKS_CLEARED: KVEventKind
KV_MEDIUM_DEVICE: KVMedium
KV_MEDIUM_HOST: KVMedium

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "stop", "include_stop_str_in_output", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "prompt_logprobs", "skip_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "priority", "ttft_deadline_ms", "ttft_slo_ms", "add_special_tokens", "json_schema", "json_object", "regex", "grammar", "choice")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    priority: int
    ttft_deadline_ms: float
    ttft_slo_ms: float
    add_special_tokens: bool
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., ttft_deadline_ms: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., add_special_tokens: _Optional[bool] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "replica_id", "logprobs", "top_logprobs", "stop_string", "stop_token_id", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    replica_id: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    stop_string: str
    stop_token_id: int
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., replica_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top_logprobs", "start")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    start: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., start: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "max_model_len", "vocab_size", "block_size", "eos_token_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_id: int
    def __init__(self, model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("max_interval_ms",)
    MAX_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    max_interval_ms: int
    def __init__(self, max_interval_ms: _Optional[int] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "seq", "timestamp", "kv_blocks_total", "kv_blocks_free", "block_size", "kv_usage", "headroom_tokens", "num_running", "num_waiting", "waiting_prefill_tokens", "preemptions_total", "preemption_rate", "preemption_rate_per_running", "recomputed_tokens_total", "step_time_ms", "generation_tokens_per_s", "max_num_seqs", "kv_committed_tokens", "admissions_held_total", "expected_output_tokens", "host_kv_blocks_total", "host_kv_blocks_free", "swap_preemptions_total", "recompute_tokens_avoided_total", "host_hit_cost_ratio", "prefetched_blocks_total", "copy_wait_steps_total", "copy_wait_blocks_total", "load_age_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_RATE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_RATE_PER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_HELD_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    SWAP_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_AVOIDED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COPY_WAIT_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COPY_WAIT_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    seq: int
    timestamp: float
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    kv_usage: float
    headroom_tokens: int
    num_running: int
    num_waiting: int
    waiting_prefill_tokens: int
    preemptions_total: int
    preemption_rate: float
    preemption_rate_per_running: float
    recomputed_tokens_total: int
    step_time_ms: float
    generation_tokens_per_s: float
    max_num_seqs: int
    kv_committed_tokens: int
    admissions_held_total: int
    expected_output_tokens: int
    host_kv_blocks_total: int
    host_kv_blocks_free: int
    swap_preemptions_total: int
    recompute_tokens_avoided_total: int
    host_hit_cost_ratio: float
    prefetched_blocks_total: int
    copy_wait_steps_total: int
    copy_wait_blocks_total: int
    load_age_ms: float
    def __init__(self, replica_id: _Optional[str] = ..., seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_usage: _Optional[float] = ..., headroom_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., waiting_prefill_tokens: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., preemption_rate: _Optional[float] = ..., preemption_rate_per_running: _Optional[float] = ..., recomputed_tokens_total: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., kv_committed_tokens: _Optional[int] = ..., admissions_held_total: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., host_kv_blocks_total: _Optional[int] = ..., host_kv_blocks_free: _Optional[int] = ..., swap_preemptions_total: _Optional[int] = ..., recompute_tokens_avoided_total: _Optional[int] = ..., host_hit_cost_ratio: _Optional[float] = ..., prefetched_blocks_total: _Optional[int] = ..., copy_wait_steps_total: _Optional[int] = ..., copy_wait_blocks_total: _Optional[int] = ..., load_age_ms: _Optional[float] = ...) -> None: ...

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hash", "parent_hash", "medium")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    kind: KVEventKind
    block_hash: bytes
    parent_hash: bytes
    medium: KVMedium
    def __init__(self, kind: _Optional[_Union[KVEventKind, str]] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., medium: _Optional[_Union[KVMedium, str]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("replica_id", "seq", "snapshot", "block_size", "events")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    seq: int
    snapshot: bool
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, replica_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
