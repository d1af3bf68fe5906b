"""The model's shape and numerics, parsed once from a Hugging Face `config.json`.

Accepts both rope spellings: `rope_theta`/`rope_scaling` (transformers < 5) and
`rope_parameters` (transformers 5). Anything the model cannot run is rejected here by name.
Without torch (the dtype is kept by name): the engine core sends this config to the front,
which must unpickle it without the model stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a dtype name becomes a torch.dtype
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
_REQUIRED_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class ModelConfigError(ValueError):
    """A config.json this model implementation cannot run."""


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor at fault.
    (Raised by the loader; defined here, without torch, so the front can receive it.)"""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "linear" | "llama3", plus that type's parameters}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not
    mlp_bias: bool
    dtype: str  # the checkpoint's own, one of DTYPE_NAMES (torch_dtype: as torch's)
    eos_token_ids: tuple[int, ...]  # config.json may give one id or a list
    sliding_window: int | None  # Mistral v0.1; attention here is full, so contexts stop at the window

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def max_model_len(self) -> int:
        """Longest context this implementation reproduces exactly (full attention == a window it fits in)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if isinstance(architectures, str):  # one name, not a list: its letters were the names tried
            architectures = [architectures]
        if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
            raise ModelConfigError(f"architectures {architectures!r}: not a list of names")
        architecture = next((name for name in architectures if name in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ModelConfigError(
                f"unsupported architecture {', '.join(architectures) or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantization = raw.get("quantization_config")
        if quantization is not None:
            # Its weights are stored quantized, with scales beside them: read as plain floats they
            # are wrong by their scales (an FP8 checkpoint loaded "fine" and answered nonsense).
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ModelConfigError(f"quantization_config (quant_method {method!r}): quantized checkpoints are not "
                                   "supported; use the model's unquantized (bf16/fp16/fp32) weights")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {hidden_act!r} is not supported; only 'silu' (SwiGLU) is")

        num_attention_heads = _positive_int(raw, "num_attention_heads")
        num_key_value_heads = _positive_int(raw, "num_key_value_heads", num_attention_heads)
        if num_attention_heads % num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({num_key_value_heads})"
            )
        hidden_size = _positive_int(raw, "hidden_size")
        vocab_size = _positive_int(raw, "vocab_size")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(_is_int(token_id) and 0 <= token_id < vocab_size for token_id in eos_token_ids):
            # An id no output can be would never end a request.
            raise ModelConfigError(f"eos_token_id {eos!r}: not token ids of the vocabulary (0 to {vocab_size - 1})")
        # Mistral's window is 4096 unless config.json says otherwise (null: none), as transformers reads it.
        mistral_default = 4096 if architecture == "MistralForCausalLM" and "sliding_window" not in raw else None
        sliding_window = _positive_int(raw, "sliding_window", mistral_default)
        if is_qwen2 and not raw.get("use_sliding_window", False):
            sliding_window = None  # Qwen2 writes a window it does not use
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=_positive_int(raw, "head_dim", None) or _whole_heads(hidden_size, num_attention_heads),
            rms_norm_eps=_finite("rms_norm_eps", raw.get("rms_norm_eps", 1e-6), positive=True),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", 2048, at_most=MAX_POSITION_EMBEDDINGS),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32", field="torch_dtype"),
            eos_token_ids=eos_token_ids,
            sliding_window=sliding_window,
        )


def dtype_name(name: str, *, field: str = "dtype") -> str:
    """`name` if it is one of DTYPE_NAMES, else ModelConfigError naming `field`."""
    if name not in DTYPE_NAMES:
        raise ModelConfigError(f"{field} {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return name


def parse_dtype(name: str | torch.dtype, *, field: str = "dtype") -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, dtype_name(name, field=field))


# Bytes per element of each of DTYPE_NAMES, as torch stores it (a test holds them to torch's).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """The KV heads each of `size` tensor-parallel ranks holds: its share, or one replicated
    head where the model has fewer KV heads than ranks."""
    return max(1, cfg.num_key_value_heads // size)


def kv_block_bytes(cfg: ModelConfig, block_size: int, element_size: int, tp_size: int = 1) -> int:
    """Keys and values of one KV block across all layers, in elements of `element_size` bytes:
    what one rank of `tp_size` holds of it (its kv_heads_per_rank). The pool sizing's and the
    host tier's arithmetic (replica/executor/memory_profile.py, replica/executor/rank_config.py),
    here without torch so that `headroom serve` checks a host tier before Ray starts."""
    return 2 * cfg.num_hidden_layers * block_size * kv_heads_per_rank(cfg, tp_size) * cfg.head_dim * element_size


def host_kv_block_bytes(cfg: ModelConfig, block_size: int, element_size: int, tp_size: int = 1) -> int:
    """One block of a replica's host KV tier of the model `cfg` (the whole model's) under
    tensor parallelism over `tp_size` ranks: every rank's shard of it, all in the node's memory."""
    return tp_size * kv_block_bytes(cfg, block_size, element_size, tp_size)


# The rotary table is built for every position up to this (16 Mi: past any model's context).
MAX_POSITION_EMBEDDINGS = 1 << 24
_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(raw: dict[str, Any], key: str, default: Any = _MISSING, at_most: int | None = None) -> Any:
    """raw[key] as a size: an integer >= 1 (and <= at_most); `default` where it is absent or
    null, ModelConfigError naming the key otherwise (a negative, fractional or string size
    failed deep in the model's construction, or made it allocate without end)."""
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise ModelConfigError(f"config.json has no {key!r}")
        return default
    if not _is_int(value) or value < 1 or (at_most is not None and value > at_most):
        wanted = f"an integer from 1 to {at_most}" if at_most is not None else "an integer >= 1"
        raise ModelConfigError(f"{key} {value!r}: must be {wanted}")
    return value


def _whole_heads(hidden_size: int, num_heads: int) -> int:
    if hidden_size % num_heads:
        raise ModelConfigError(f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}); "
                               "give head_dim")
    return hidden_size // num_heads


def _finite(key: str, value: Any, positive: bool = False) -> float:
    """`value` as a finite float (> 0 with `positive`); ModelConfigError naming the key."""
    try:
        number = float(value) if not isinstance(value, (bool, str)) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (positive and number <= 0):
        raise ModelConfigError(f"{key} {value!r}: must be a finite number{' > 0' if positive else ''}")
    return number


def _rope_fields(params: dict[str, Any]) -> dict[str, Any]:
    """A rope dict's scaling fields, the pre-4.45 `type` read as `rope_type`, without the theta."""
    fields = {key: value for key, value in params.items() if key not in ("rope_theta", "type")}
    fields["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return fields


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either the transformers 5 or the older spelling.
    Where a config gives the same thing twice and the two disagree (rope_scaling beside
    rope_parameters, a rope_theta inside them beside the top-level one, a top-level
    original_max_position_embeddings beside the nested one), it is refused naming both:
    transformers' precedence among them has changed between versions, and either reading
    silently differed from it."""
    modern = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    legacy = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) and raw.get("rope_scaling") else None
    if modern is not None and legacy is not None and _rope_fields(modern) != _rope_fields(legacy):
        raise ModelConfigError(f"rope_scaling {legacy!r} and rope_parameters {modern!r} disagree; give one")
    params = dict(modern if modern is not None else legacy or {})
    nested_theta = params.pop("rope_theta", None)
    top_theta = raw.get("rope_theta")
    if nested_theta is not None and top_theta is not None and nested_theta != top_theta:
        raise ModelConfigError(f"rope_theta {top_theta!r} and the rope parameters' rope_theta {nested_theta!r} "
                               "disagree; give one")
    rope_theta = nested_theta if nested_theta is not None else top_theta if top_theta is not None else 10000.0
    top_original = raw.get("original_max_position_embeddings")
    if (top_original is not None and "original_max_position_embeddings" in params
            and params["original_max_position_embeddings"] != top_original):
        raise ModelConfigError(f"original_max_position_embeddings {top_original!r} and the rope parameters' "
                               f"{params['original_max_position_embeddings']!r} disagree; give one")
    params = _rope_fields(params)  # the pre-4.45 `type` read as rope_type
    rope_type = params.pop("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError("partial_rotary_factor other than 1.0 is not supported")
    missing = [key for key in _REQUIRED_ROPE_KEYS[rope_type] if key not in params]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} needs {', '.join(missing)}")
    # A rope_theta or factor of 0 (or NaN) made the rotary table non-finite: every output NaN.
    rope_theta = _finite("rope_theta", rope_theta, positive=True)
    for key in _REQUIRED_ROPE_KEYS[rope_type]:
        _finite(f"rope scaling {key}", params[key], positive=True)
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **{key: params[key] for key in _REQUIRED_ROPE_KEYS[rope_type]}}
