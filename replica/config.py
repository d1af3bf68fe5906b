"""Typed configuration of one replica's engine, validated once where it enters.

Defaults follow vLLM where it has one: block size 16, chunked prefill on, prefix caching
on, FCFS, watermark 0, and our full-sequence admission check on. The `slo_*` knobs tune
the TTFT-SLO policy (replica/core/slo.py) and are inert under the other policies.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from replica.core.admission import AdmissionMode
from replica.errors import InvalidRequestError

# The kernels' names live here, not beside the kernels, so the config (and the ingress and
# the CLI that read it) imports without torch.
FUSED_OPS_NAMES = ("auto", "torch", "inplace", "triton", "compile")
# The one default: EngineConfig.fused_ops and load_model both take it from here.
DEFAULT_FUSED_OPS = "auto"
ATTENTION_BACKEND_NAMES = ("auto", "torch", "triton")

SchedulingPolicy = Literal["fcfs", "priority", "slo"]
VictimPolicy = Literal["fcfs", "priority", "cheapest"]
PreemptionMode = Literal["recompute", "swap", "auto"]
FusedOpsName = Literal[FUSED_OPS_NAMES]  # type: ignore[valid-type]
GenerationConfigMode = Literal["auto", "none"]

# The KV block sizes a config may name: the powers of two from 1 to 256 (EngineConfig.block_size).
BLOCK_SIZES = tuple(1 << shift for shift in range(9))
# The longest timeout or interval a wait takes (threading.TIMEOUT_MAX, about 292 years): a longer
# one overflows threading.Event.wait (OverflowError in the SLO monitor's thread), and torch keeps a
# collective's timeout in microseconds, where a timedelta past about 9.2e12 s wraps negative.
MAX_WAIT_S = threading.TIMEOUT_MAX

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An impossible configuration; the message names the field."""


class NumbersNotBooleans(BaseModel):
    """A model whose number fields refuse a boolean, naming the field: pydantic's lax mode reads
    `true` as 1 (YAML's or JSON's `true` for `block_size`, Helm's `--set x=true`, an OpenAI body's
    `"max_tokens": true`), a silent value nobody chose. Other lax conversions stay: a numeric
    string ("8", a quoted YAML number, Helm's --set-string) means the number it spells, as the
    command line's flags do (argparse converts those before they get here), and a whole float
    (16.0) is the integer it equals; a float with a fraction is refused for an integer."""

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        # Once per model over the keys given, against the fields that hold numbers: a validator
        # on every field cost an OpenAI body's parse 16 us more, this a few.
        if isinstance(data, Mapping):
            number_fields = _number_fields(cls)
            errors = [error for key, value in data.items()
                      if key in number_fields and isinstance(value, (bool, Mapping, list))
                      for error in _booleans_for_numbers(value, number_fields[key], (key,))]
            if errors:  # located below the field: a router knob is named as knobs.NAME
                raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


@functools.cache
def _number_fields(model: type[BaseModel]) -> dict[str, Any]:
    """The fields (by the key a document names them with) whose values are, or hold, numbers."""
    def holds_numbers(annotation: Any) -> bool:
        return _takes_numbers_not_booleans(annotation) or any(holds_numbers(argument)
                                                               for argument in typing.get_args(annotation))

    return {field.alias or name: field.annotation for name, field in model.model_fields.items()
            if holds_numbers(field.annotation)}


class ConfigModel(NumbersNotBooleans):
    """The base of every config model (EngineConfig, and cluster/config.py's tree): unknown keys,
    NaN, infinity and booleans given for numbers are refused, each naming its field.

    NaN or infinity in a knob is a typo or a unit slip, never a setting: NaN passes no comparison
    (a bound such as `>= 0` is no guard), and an infinite timeout or interval overflows the
    thread and timedelta calls it reaches (threading.Event.wait, datetime.timedelta).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _takes_numbers_not_booleans(annotation: Any) -> bool:
    """Whether a field of this type holds a number (int or float, or an Optional of one)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        return bool not in members and any(_takes_numbers_not_booleans(member) for member in members)
    return False


def _booleans_for_numbers(value: Any, annotation: Any, loc: tuple) -> list[InitErrorDetails]:
    """An error for each boolean in `value` where `annotation` wants a number, in a mapping's values too."""
    if isinstance(value, bool):
        if not _takes_numbers_not_booleans(annotation):
            return []
        error = PydanticCustomError("bool_for_number", "Input should be a number, not the boolean {boolean}",
                                    {"boolean": "true" if value else "false"})
        return [InitErrorDetails(type=error, loc=loc, input=value)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[dict[...]]: the one container
        containers = [member for member in typing.get_args(annotation) if typing.get_origin(member) is not None]
        annotation = containers[0] if len(containers) == 1 else annotation
    origin = typing.get_origin(annotation)
    if isinstance(value, Mapping) and origin in (dict, Mapping):
        value_type = typing.get_args(annotation)[1]
        return [error for key, item in value.items() for error in _booleans_for_numbers(item, value_type, (*loc, key))]
    if isinstance(value, list) and origin is list and _takes_numbers_not_booleans(typing.get_args(annotation)[0]):
        return [error for index, item in enumerate(value) if isinstance(item, bool)
                for error in _booleans_for_numbers(item, int, (*loc, index))]
    return []


# A sequence is at least a prompt token and the one it generates.
MIN_MAX_MODEL_LEN = 2


class EngineConfig(ConfigModel):
    block_size: int = Field(
        16,
        description="Tokens per KV cache block: a power of two from 1 to 256. Correctness needs no more: the "
        "attention kernels (Triton and torch) find a token's slot by // and % of it and tile keys by sizes of their "
        "own, and the prefix cache hashes whole blocks of any size. Other sizes are refused as likely typos: a power "
        "of two keeps that slot arithmetic to shifts, these are vLLM's sizes (1, 8-256) plus 2 and 4, so a config "
        "carries over, and a larger block only wastes more of each sequence's last, partly filled block and "
        "coarsens prefix-cache hits, which count whole blocks.",
    )
    num_kv_blocks: int = Field(
        2048, ge=2, description="KV cache blocks in the pool, including the reserved null block."
    )
    max_model_len: Optional[int] = Field(
        None, ge=MIN_MAX_MODEL_LEN,
        description="Longest sequence (prompt + output) in tokens; unset (null): the model's context length (SmolLM2: 8192) "
        "where the KV pool holds one such sequence, else as many tokens as it holds (resolve_max_model_len).",
    )
    generation_config: GenerationConfigMode = Field(
        "auto",
        description="Where a request's unset sampling parameters come from. auto (vLLM's --generation-config "
        "default): the model's generation_config.json, where it gives temperature, top_p, top_k, min_p or "
        "repetition_penalty, and its max_new_tokens as the most an unset max_tokens means (logged at start); "
        "none (vLLM's 'vllm'): ignore the file, so unset means temperature 1, top_p 1, no top_k, min_p or "
        "repetition penalty, max_tokens up to the context. A request's own values always win. do_sample is not "
        "read, as vLLM does not read it.",
    )
    max_num_batched_tokens: int = Field(2048, description="Token budget of one engine step.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests running at once.")
    enable_chunked_prefill: bool = Field(
        True, description="Split a prompt longer than the step's token budget over several steps (else it waits for a "
        "step with room for it whole).")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="When > 0, the most prompt tokens one request may run in a step."
    )
    enable_prefix_caching: bool = Field(
        True, description="Keep finished requests' full KV blocks and reuse them for prompts that share the prefix.")
    prefix_cache_protected_share: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Eviction order of the prefix cache (segmented LRU): freed blocks that were shared (a prefix-cache "
        "hit while another request held them: a tenant's system prompt) are evicted only after every other freed "
        "block, up to this fraction of the KV blocks; beyond it, and within each kind, least recently freed first. "
        "0: plain LRU, as vLLM.")
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs", description="Order of the waiting queue: fcfs (arrival), priority (the request's priority, then "
        "arrival) or slo (TTFT-deadline urgency: docs/architecture.md).")
    victim_policy: Optional[VictimPolicy] = Field(
        None,
        description="Who is preempted when memory runs out; None follows scheduling_policy. "
        "'cheapest' preempts the running request that is cheapest to rebuild.",
    )
    watermark: float = Field(
        0.0, description="Fraction of KV blocks that new admissions must leave free while something runs."
    )
    reserve_full_sequence: bool = Field(
        True, description="Admit a request only if its whole prompt fits, not just its first chunk."
    )
    admission_mode: AdmissionMode = Field(
        "optimistic",
        description="optimistic (vLLM's): admit what fits now; reserve_max_tokens (mini-SGLang's): admit only if "
        "every running request and this one could grow to max_tokens; reserve_expected: the same with each "
        "request's expected output length, learned from finished requests and capped by max_tokens.",
    )
    admission_max_hold_ms: Optional[float] = Field(
        500.0, gt=0,
        description="Under the reserve modes, how long the growth reserve may block the queue: the reserve a waiting "
        "request needs shrinks linearly from all to none over this time since the latest of its arrival (or requeue), "
        "the replica's last admission on the whole reserve and its last preemption; then it is admitted as the "
        "optimistic mode would. A request that can still make its TTFT SLO is held at most until its latest start (its "
        "deadline less its predicted TTFT); one past that is held over admission_max_hold_late_ms instead; a "
        "preempted stream keeps the whole hold. None: holds are unbounded.",
    )
    admission_max_hold_late_ms: Optional[float] = Field(
        1000.0, gt=0,
        description="admission_max_hold_ms for a request past its latest start (it will miss its TTFT SLO whenever it "
        "starts; at least admission_max_hold_ms). Let in early it saves no TTFT, and admitted on a waived reserve it "
        "is the next preemption victim, so it is held longer. None: unbounded.",
    )
    max_waiting_requests: int = Field(
        4096, ge=1, description="Bound of the waiting queue; beyond it new requests are refused."
    )
    default_ttft_slo_ms: Optional[float] = Field(
        None, gt=0, description="TTFT SLO of requests that name none; None leaves them without a deadline."
    )
    slo_predictor_per_token_ms: float = Field(
        0.05, ge=0, description="Starting slope of the TTFT predictor (ms per prompt token), until it is fitted."
    )
    slo_predictor_base_ms: float = Field(
        20.0, ge=0, description="Starting intercept of the TTFT predictor (ms), until it is fitted."
    )
    slo_predictor_window: int = Field(
        64, ge=2, description="Measured prefills the TTFT predictor's least-squares fit covers."
    )
    slo_doomed_max_wait_ms: Optional[float] = Field(
        None, gt=0,
        description="A waiter past its TTFT deadline that has waited this long since it arrived goes ahead of "
        "rescuable ones, oldest first, for at most slo_doomed_share of the admissions: a bound on how long the SLO "
        "queue leaves a doomed request behind rescuable ones under a sustained overload, paid for in requests within "
        "their SLO (docs/architecture.md). None: no bound.",
    )
    slo_doomed_share: float = Field(
        1.0, gt=0, le=1.0,
        description="The share of admissions overdue waiters may take (slo_doomed_max_wait_ms); 1: all they need.",
    )
    slo_preemption_margin: float = Field(
        1.2, ge=1.0, description="How many times more urgent than a running prefill a waiter must be to abort it."
    )
    slo_aggressive: bool = Field(
        False, description="Compare the waiter with the least urgent running prefill instead of the most urgent."
    )
    slo_abort_max_layer_fraction: float = Field(
        0.9, ge=0.0, le=1.0, description="A forward pass past this fraction of its layers refuses to abort."
    )
    slo_monitor_interval_ms: float = Field(
        2.0, gt=0, le=MAX_WAIT_S * 1000,
        description="How often the SLO monitor thread re-evaluates the preemption gate.",
    )
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1,
        description="CUDA only: the fraction of the GPU's total memory this engine may use (weights, "
        "activations and KV cache, as vLLM means it); the KV pool gets what a profiling run leaves, "
        "instead of num_kv_blocks. None keeps num_kv_blocks.",
    )
    enforce_eager: bool = Field(
        False, description="Run every step eagerly: no CUDA graphs for decode steps (CPU runs are always eager)."
    )
    async_scheduling: Optional[bool] = Field(
        None,
        description="Schedule step N+1 while the device runs step N (outputs then lag one step); "
        "None turns it on for CUDA and off elsewhere.",
    )
    structured_output_compile_timeout_s: float = Field(
        10.0, gt=0,
        description="Longest a request's output constraint (JSON schema, regex, grammar, choice) may take to "
        "compile. Where the request enters it counts from when a compile thread takes it: a slower one is refused "
        "as invalid input, and one that waits as long for a thread, behind others, as a full queue (retry). In the "
        "engine core, a request still waiting for its grammar this long after it arrived ends as a full queue.",
    )
    structured_output_max_mask_ms: float = Field(
        10.0, gt=0,
        description="Longest one request's token mask may take to compute per step, in its thread's CPU time "
        "(ordinary constraints take at most ~3 ms; a mask is built before its step samples, so a slower one "
        "holds the whole batch back): a "
        "constraint whose mask after its first token is slower is refused where it enters, and a request whose "
        "masks are slower 3 times (with fewer than 3 within the limit in a row between them) ends with an error.",
    )
    structured_output_step_mask_ms: float = Field(
        50.0, gt=0,
        description="Most predicted mask time (CPU time, summed over a step's constrained rows, each predicted "
        "from its own latest mask) one step may take: many constrained rows, each within "
        "structured_output_max_mask_ms, would otherwise hold every request in the batch back by their sum. "
        "Constrained rows past it wait for a later step (those that waited longest go first; at least one runs "
        "each step); unconstrained rows never wait for it.",
    )
    stream_interval: int = Field(
        1, ge=1,
        description="Tokens per streamed message after a request's first (vLLM's and SGLang's --stream-interval): "
        "the first token goes out at once, later ones are held until this many have accumulated, the last output "
        "at once with whatever is held. 1 sends every step's tokens; more sends fewer gRPC/HTTP messages (less "
        "front and client CPU per token) at the cost of burstier streams (inter-message latency up to N steps).",
    )
    stream_stall_timeout_s: float = Field(
        30.0, ge=0, le=MAX_WAIT_S,
        description="Longest a request's stream may hold outputs its reader has not taken (a client that keeps "
        "its gRPC or HTTP stream open but stops reading): past it the request is aborted, its KV blocks freed, "
        "and the stream ends with StreamStalledError (counted as finish reason abort). Its unread outputs are "
        "merged into one, so this also bounds their memory to this many seconds of the request's tokens; a "
        "reader that takes anything within it never hits it. 0: no bound.",
    )
    front_stall_timeout_s: float = Field(
        10.0, ge=0, le=MAX_WAIT_S,
        description="Longest the engine core waits for a front (a front process of the replica, not a client) "
        "to read its next output message: past it the front is taken as gone (wedged, its socket full), its "
        "requests aborted, its unsent outputs dropped and its channel closed, as if its process had died; the "
        "front that started the core then stops it, as its exit does. A front that reads at all, however far "
        "behind, never hits it; nor does one still starting (counted from its attach), though one that has not "
        "attached 120 s after the core started (hung while starting) is taken out too "
        "(replica/ipc/messages.py's FRONT_ATTACH_TIMEOUT_S). 0: no bound, for either.",
    )
    fused_ops: FusedOpsName = Field(
        DEFAULT_FUSED_OPS,
        description="RMSNorm, add + RMSNorm, rotary and SiLU-mul: auto (Triton kernels on CUDA, inplace "
        "elsewhere), torch (the reference), inplace (the reference's results bit for bit, in fewer passes), "
        "triton or compile (torch.compile of the reference).",
    )
    borrow_idle_cpus_min_tokens: int = Field(
        256, ge=0,
        description="CPU engine-core process only: a step of at least this many tokens also runs on the cores "
        "no other thread is using at that moment, beyond its base torch threads (Ray's reservation under Serve, "
        "--torch-threads, or torch's default), so a lone long prefill is not held to one reserved core while the "
        "others idle; shorter steps keep the base. 0: never (replica/executor/cpu_threads.py).",
    )

    tensor_parallel_size: int = Field(
        1, ge=1,
        description="Ranks (devices) one replica's model and KV cache are sharded across, Megatron-style: worker "
        "processes beside the engine core, gloo on CPU, NCCL on CUDA. Must divide the model's attention heads "
        "and MLP width, and its KV heads or be a multiple of them (checked at start); the vocabulary is padded.",
    )
    tensor_parallel_timeout_s: float = Field(
        60.0, gt=0, le=MAX_WAIT_S,
        description="Longest one tensor-parallel collective may wait for the other ranks; past it (a rank hung, "
        "or died unseen) the replica reports itself dead instead of waiting forever.",
    )

    num_host_kv_blocks: int = Field(
        0, ge=0,
        description="KV blocks of the host-memory tier (pinned on CUDA): preempted requests swap into it and "
        "prefix-cache blocks evicted from the device spill into it. 0 (with host_kv_bytes unset): no host tier.",
    )
    host_kv_bytes: Optional[int] = Field(
        None, gt=0,
        description="The host tier's size in bytes instead of num_host_kv_blocks (turned into whole blocks of the "
        "model at start); must fit the host's memory and, checked where the replica starts, its container's "
        "memory limit. Under tensor parallelism, all ranks' shards together.",
    )
    preemption_mode: PreemptionMode = Field(
        "auto",
        description="What a preempted request's KV becomes: recompute (dropped, re-prefilled later), swap (copied to "
        "the host tier and back; recompute when the tier is full) or auto (per victim, whichever costs less time).",
    )
    preemption_recompute_s_per_token: Optional[float] = Field(
        None, gt=0,
        description="Seconds one token takes to re-prefill, for the auto preemption mode; None: measured at start.",
    )
    preemption_swap_bytes_per_s: Optional[float] = Field(
        None, gt=0,
        description="Device<->host copy bandwidth in bytes per second, for the auto preemption mode; None: measured "
        "at start.",
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> "EngineConfig":
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size: must be a power of two from 1 to {BLOCK_SIZES[-1]}, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark: must be in [0, 1), got {self.watermark}")
        if self.host_kv_bytes is not None and self.num_host_kv_blocks:
            raise ConfigError("host_kv_bytes: set it or num_host_kv_blocks, not both")
        if self.host_kv_bytes is not None and self.host_kv_bytes > (host_bytes := host_memory_bytes()):
            raise ConfigError(f"host_kv_bytes: {self.host_kv_bytes} bytes exceeds the host's memory "
                              f"({host_bytes} bytes)")
        if self.preemption_mode == "swap" and not self.has_host_tier:
            raise ConfigError("preemption_mode: 'swap' needs a host KV tier (set num_host_kv_blocks or host_kv_bytes)")
        if self.has_host_tier and self.preemption_mode == "recompute" and not self.enable_prefix_caching:
            # Nothing would ever enter it: victims are recomputed, and no cached block spills.
            field = "host_kv_bytes" if self.host_kv_bytes is not None else "num_host_kv_blocks"
            raise ConfigError(f"{field}: a host KV tier holds swapped-out requests and spilled prefix-cache "
                              "blocks; with preemption_mode 'recompute' and prefix caching off it would hold nothing")
        if self.max_model_len is None:  # checked once the model's context is known (resolve_max_model_len)
            # ... which can be no shorter than the pool or, with chunked prefill off, one step allows.
            if self.gpu_memory_utilization is None and self.pool_tokens < MIN_MAX_MODEL_LEN:
                raise ConfigError(f"num_kv_blocks: {self.num_kv_blocks} blocks of {self.block_size} tokens (one "
                                  f"is the reserved null block) hold {self.pool_tokens}; a sequence needs at "
                                  f"least {MIN_MAX_MODEL_LEN}")
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < MIN_MAX_MODEL_LEN:
                raise ConfigError(f"max_num_batched_tokens: with chunked prefill off it bounds max_model_len, "
                                  f"which must be >= {MIN_MAX_MODEL_LEN}; got {self.max_num_batched_tokens}")
            return self
        if self.gpu_memory_utilization is None:
            # With it, a profiling run on CUDA sizes the pool (memory_profile checks it holds one
            # max_model_len sequence); elsewhere it is ignored and resolve_rank_config checks this.
            self.check_pool_holds_max_model_len()
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens: with chunked prefill off it must be >= max_model_len "
                f"({self.max_model_len}) or long prompts could never run; got {self.max_num_batched_tokens}"
            )
        return self

    def check_pool_holds_max_model_len(self) -> None:
        """ConfigError naming num_kv_blocks unless the pool holds one max_model_len sequence."""
        blocks_per_max_seq = -(-self.max_model_len // self.block_size)
        if self.num_usable_blocks < blocks_per_max_seq:
            raise ConfigError(
                f"num_kv_blocks: {self.num_kv_blocks} blocks (one is the reserved null block) cannot hold "
                f"one max_model_len={self.max_model_len} sequence, which needs {blocks_per_max_seq} "
                f"blocks of {self.block_size} tokens plus the null block"
            )

    @property
    def has_host_tier(self) -> bool:
        return self.num_host_kv_blocks > 0 or self.host_kv_bytes is not None

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds, the null block aside."""
        return self.num_usable_blocks * self.block_size

    @property
    def num_usable_blocks(self) -> int:
        return self.num_kv_blocks - 1

    @property
    def resolved_victim_policy(self) -> VictimPolicy:
        # Under "slo", memory pressure still preempts the most recently admitted: the SLO
        # preemption of running prefills is a separate mechanism (replica/core/slo_monitor.py).
        if self.victim_policy is not None:
            return self.victim_policy
        return "fcfs" if self.scheduling_policy == "slo" else self.scheduling_policy

    def check_request_priority(self, priority: int) -> None:
        """A request's priority where nothing here orders by it is refused naming it, as vLLM
        refuses it ("Priority scheduling is not enabled"), not silently ignored."""
        if priority and "priority" not in (self.scheduling_policy, self.resolved_victim_policy):
            raise InvalidRequestError("priority", f"needs scheduling_policy or victim_policy 'priority'; these "
                                                  f"replicas schedule {self.scheduling_policy!r}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_usable_blocks)


def host_memory_bytes() -> int:
    """The host's physical memory: the bound of the host KV tier wherever the config is read
    (the replica, once started, also bounds it by its container's limit: replica_memory_bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def cgroup_control_files(v2_name: str, v1_controller: str, v1_name: Optional[str],
                         cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP) -> list[str]:
    """The text of one control file in this process's cgroup and in each of its ancestors, where
    readable: `v2_name` under cgroup v2, `v1_name` under the `v1_controller` hierarchy of v1 (None:
    v2 only). A container that mounts only its own cgroup sees it at the root, whatever path
    /proc/self/cgroup names, so every ancestor of that path down to the root is read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    texts = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            base, name = Path(cgroup_root), v2_name
        elif v1_name is not None and v1_controller in controllers.split(","):
            base, name = Path(cgroup_root) / v1_controller, v1_name
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            try:
                texts.append(base.joinpath(*parts[:depth], name).read_text().strip())
            except OSError:
                continue
    return texts


def container_memory_limit_bytes(cgroup_root: str = CGROUP_ROOT,
                                 proc_cgroup: str = PROC_SELF_CGROUP) -> Optional[int]:
    """The lowest memory limit of this process's cgroup and its ancestors (a container's, such as
    a Kubernetes pod's limits.memory); None where none is readable. cgroup v2 (memory.max, "max"
    when unlimited) and v1 (memory/memory.limit_in_bytes, a number near 2**63 when unlimited)."""
    texts = cgroup_control_files("memory.max", "memory", "memory.limit_in_bytes", cgroup_root, proc_cgroup)
    return min((int(text) for text in texts if text.isdigit()), default=None)


def container_cpu_quota(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP) -> Optional[float]:
    """The CPUs the lowest cgroup v2 quota of this process's cgroup and its ancestors allows
    (cpu.max "200000 100000" -> 2.0); None without a quota."""
    quotas = []
    for text in cgroup_control_files("cpu.max", "cpu", None, cgroup_root, proc_cgroup):
        try:
            quota, period = text.split()[:2]
            quotas.append(int(quota) / int(period))
        except (ValueError, ZeroDivisionError):  # "max": no quota there
            continue
    return min(quotas, default=None)


def replica_memory_bytes() -> tuple[int, str]:
    """The memory a started replica may use, and what bounds it: the host's physical memory, or
    its container's lower limit (a host tier past it would be killed for memory, not refused)."""
    physical = host_memory_bytes()
    limit = container_memory_limit_bytes()
    if limit is not None and limit < physical:
        return limit, "its container's memory limit"
    return physical, "the host's memory"


def make_engine_config(**overrides) -> EngineConfig:
    """Build an EngineConfig, turning pydantic's errors into one ConfigError naming the field."""
    from pydantic import ValidationError

    try:
        return EngineConfig(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        ctx_error = first.get("ctx", {}).get("error")
        if isinstance(ctx_error, ConfigError):
            raise ctx_error from None
        raise ConfigError(f"{loc or 'config'}: {first['msg']}") from None


def resolve_host_kv_blocks(config: EngineConfig, bytes_per_block: int) -> EngineConfig:
    """`config` with its host KV tier in blocks of `bytes_per_block` (a block's keys and values
    across all layers), checked against the memory this replica may use (replica_memory_bytes:
    the host's, or its container's lower limit). Runs where the replica starts, so the bound is
    that machine's and that container's, not the one that read the config."""
    memory_bytes, bound = replica_memory_bytes()
    if config.host_kv_bytes is not None:
        num_blocks = config.host_kv_bytes // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(f"host_kv_bytes: {config.host_kv_bytes} bytes hold no KV block of this model "
                              f"({bytes_per_block} bytes)")
        if config.host_kv_bytes > memory_bytes:
            raise ConfigError(f"host_kv_bytes: {config.host_kv_bytes} bytes exceeds {bound} ({memory_bytes} bytes)")
        return make_engine_config(**{**config.model_dump(), "host_kv_bytes": None, "num_host_kv_blocks": num_blocks})
    if config.num_host_kv_blocks * bytes_per_block > memory_bytes:
        raise ConfigError(f"num_host_kv_blocks: {config.num_host_kv_blocks} blocks of {bytes_per_block} bytes exceed "
                          f"{bound} ({memory_bytes} bytes)")
    return config


def resolve_max_model_len(config: EngineConfig, model_max_len: int, pool_sized_later: bool = False) -> EngineConfig:
    """`config` with max_model_len decided for a model whose context is model_max_len tokens.

    An explicit max_model_len must fit the model. None follows the model, as vLLM's default does,
    where the KV pool (num_kv_blocks) can hold one sequence that long and, with chunked prefill
    off, one step's budget can run its prompt; else it is as long as they allow, and a warning
    says which bound it met (vLLM refuses to start there instead). `pool_sized_later`: a
    profiling run sizes the pool after this (gpu_memory_utilization on CUDA), so num_kv_blocks
    is no bound yet; the caller resolves again once the pool is sized.
    """
    if config.max_model_len is not None:
        if config.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len: {config.max_model_len} exceeds the model's {model_max_len}")
        return config
    bounds = {"the model's context": model_max_len}
    if not pool_sized_later:
        bounds["the KV pool (num_kv_blocks x block_size, less the null block)"] = config.pool_tokens
    if not config.enable_chunked_prefill:
        bounds["max_num_batched_tokens (chunked prefill is off)"] = config.max_num_batched_tokens
    bound, max_model_len = min(bounds.items(), key=lambda item: item[1])
    if max_model_len < model_max_len:
        logger.warning("max_model_len: %d, not the model's %d: %s holds no more (set max_model_len, num_kv_blocks "
                       "or max_num_batched_tokens to choose)", max_model_len, model_max_len, bound)
    return make_engine_config(**{**config.model_dump(), "max_model_len": max_model_len})
