"""GGUF checkpoints (llama.cpp's one-file format) for llama-architecture models: read with the
`gguf` package, every tensor dequantized once to float32, q/k rows un-permuted back to Hugging
Face's rotary layout, and written as the Hugging Face-style directory the normal loader reads
(config.json, model.safetensors, tokenizer files, chat template), cached by the file (its size,
first and last MiB and modification time).

The weights are converted one safetensors shard at a time (at most MAX_SHARD_BYTES of float32
each, with Hugging Face's index when there are several), so converting a model never holds
more of it than one shard; the loader then reads each tensor-parallel rank's slices alone.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file

from replica.model.cache import build_once, converted_gguf_dir, default_cache_dir, report_progress
from replica.model.config import ModelConfig, ModelConfigError, ModelLoadError
from replica.model.checkpoint import SHARD_INDEX_FILE, SINGLE_WEIGHTS_FILE, check_layer_count
from replica.model.gguf_tokenizer import (
    GGUFTokenizerError, tokenizer_config_from_gguf_metadata, tokenizer_from_gguf_metadata,
)
from replica.text.chat_template import ChatTemplateError, check_chat_template

logger = logging.getLogger(__name__)


SUPPORTED_ARCHITECTURES = ("llama",)
# A converted shard's float32 bytes at most (a single larger tensor is a shard of its own):
# Hugging Face's own default shard size, and what conversion holds in memory at once.
MAX_SHARD_BYTES = 5 * 10**9
_T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (
    _T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
)

# GGUF tensor name -> Hugging Face Llama parameter name ("{}" is the layer index).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be converted; the message names the file and the key or tensor at fault."""


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face-style directory of a GGUF file, converted on first use and cached."""
    gguf_path = Path(path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = converted_gguf_dir(gguf_path, cache_root)
    if target.is_dir():
        return target
    started = time.monotonic()
    report_progress(f"converting {gguf_path.name} (dequantizing to float32) into {target}")
    build_once(target, lambda staging_dir: write_hf_checkpoint(gguf_path, staging_dir))
    report_progress(f"converted {gguf_path.name} in {time.monotonic() - started:.1f} s")
    return target


def write_hf_checkpoint(gguf_path: Path, model_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Every file of a Hugging Face Llama checkpoint equivalent to the GGUF file."""
    reader = read_gguf(gguf_path)
    try:
        metadata = gguf_metadata(reader)
        config = hf_config_from_gguf(metadata, reader, gguf_path)
        # What the loader will refuse in config.json, refused now (and before un-permuting by it).
        ModelConfig.from_hf_config(config)
        check_layer_count([_hf_tensor_name(tensor.name, gguf_path) for tensor in reader.tensors],
                          config["num_hidden_layers"], gguf_path, "llama.block_count")
        check_tensor_types(reader, gguf_path)
        tokenizer = tokenizer_from_gguf_metadata(metadata)
        tokenizer_config = tokenizer_config_from_gguf_metadata(metadata)
        _check_token_ids(config, tokenizer.get_vocab_size(with_added_tokens=True))
        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is not None and not isinstance(chat_template, str):
            raise GGUFError(f"{gguf_path}: tokenizer.chat_template is not a string")
        if chat_template:
            # Converted as the file holds it: a template that does not compile is the tokenizer's
            # load error (naming this file's cached conversion), unless the server replaces it
            # (--chat-template), which is why a user would give one.
            try:
                check_chat_template(chat_template)
            except ChatTemplateError as error:
                logger.warning("%s: tokenizer.chat_template: %s (serve it with --chat-template FILE)", gguf_path, error)
    except GGUFTokenizerError as error:  # it names the key; the file too, as every error here does
        raise GGUFTokenizerError(f"{gguf_path}: {error}") from None
    except ModelLoadError:  # GGUFError (its message names the file), a layer count the weights lack
        raise
    except ModelConfigError as error:
        raise GGUFError(f"{gguf_path}: {error}") from None
    except Exception as error:  # noqa: BLE001 - malformed metadata of any kind (types, lengths, encodings)
        raise GGUFError(f"{gguf_path}: malformed metadata: {type(error).__name__}: {error}") from None
    _write_json(model_dir / "config.json", config)
    _write_json(model_dir / "generation_config.json",
                {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config})
    _write_json(model_dir / "tokenizer_config.json",
                {**tokenizer_config, "model_max_length": config["max_position_embeddings"]})
    tokenizer.save(str(model_dir / "tokenizer.json"))
    if chat_template:
        (model_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    write_weight_shards(reader, config, gguf_path, model_dir, max_shard_bytes)


def write_weight_shards(reader: GGUFReader, config: dict[str, Any], gguf_path: Path, model_dir: Path,
                        max_shard_bytes: int) -> None:
    """The weights as model.safetensors, or as numbered shards of at most max_shard_bytes with
    model.safetensors.index.json; each shard is dequantized, written and dropped before the next."""
    shards: list[list] = [[]]
    shard_bytes = 0
    for tensor in reader.tensors:  # float32 once converted: four bytes per element
        tensor_bytes = 4 * int(tensor.n_elements)
        if shards[-1] and shard_bytes + tensor_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(tensor)
        shard_bytes += tensor_bytes
    metadata = {"format": "pt", "source": gguf_path.name}
    weight_map, total_bytes = {}, 0
    for number, tensors in enumerate(shards, start=1):
        file_name = SINGLE_WEIGHTS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weights = hf_weights_from_gguf(reader, config, gguf_path, tensors)
        save_file(weights, str(model_dir / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(weights, file_name))
        total_bytes += sum(weight.numel() * weight.element_size() for weight in weights.values())
        del weights  # before the next shard is dequantized
    if len(shards) > 1:
        _write_json(model_dir / SHARD_INDEX_FILE, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


def read_gguf(gguf_path: Path) -> GGUFReader:
    try:
        _check_metadata_lengths(gguf_path)
        reader = GGUFReader(gguf_path)
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as error:
        # The reader maps the file and slices every tensor out of it: a short file fails there.
        raise GGUFError(
            f"{gguf_path}: not a readable GGUF file ({gguf_path.stat().st_size} bytes; truncated or corrupt?): {error}"
        ) from error
    _check_tensor_ranges(reader, gguf_path)
    return reader


# GGUF value types (gguf.GGUFValueType) of a fixed size, in bytes.
_FIXED_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _check_metadata_lengths(gguf_path: Path) -> None:
    """ValueError unless every string and array of the key-value section fits in the file. The
    gguf package reads an array element by element and, past the end of the file, reads nothing
    without advancing: an array claiming 2^62 elements never ended, its memory growing."""
    with open(gguf_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < 24 or data[:4] != b"GGUF":
            return  # the reader says what is wrong with it
        order = "<" if int.from_bytes(data[4:8], "little") & 0xFFFF else ">"
        size = len(data)
        position = 8

        def take(count: int, what: str) -> int:
            nonlocal position
            if count < 0 or count > size - position:
                raise ValueError(f"{what}: {count} bytes at byte {position} run past the end of the file")
            start, position = position, position + count
            return start

        def integer(fmt: str, what: str) -> int:
            start = take(struct.calcsize(fmt), what)
            return struct.unpack_from(order + fmt, data, start)[0]

        def value(value_type: int, key: str) -> None:
            if value_type in _FIXED_VALUE_BYTES:
                take(_FIXED_VALUE_BYTES[value_type], key)
            elif value_type == _STRING:
                take(integer("Q", key), key)
            elif value_type == _ARRAY:
                element_type, count = integer("I", key), integer("Q", key)
                if element_type in _FIXED_VALUE_BYTES:
                    take(count * _FIXED_VALUE_BYTES[element_type], f"metadata {key!r} ({count} elements)")
                else:  # strings or arrays: each at least 8 bytes, so a count past that cannot fit
                    if count > (size - position) // 8:
                        raise ValueError(f"metadata {key!r}: {count} elements run past the end of the file")
                    for _ in range(count):
                        value(element_type, key)
            else:
                raise ValueError(f"metadata {key!r}: unknown value type {value_type}")

        integer("Q", "tensor count")
        for index in range(integer("Q", "key-value count")):
            key_start = take(integer("Q", f"key {index}"), f"key {index}")
            key = bytes(data[key_start:position]).decode("utf-8", "replace")
            value(integer("I", key), key)


def _check_tensor_ranges(reader: GGUFReader, gguf_path: Path) -> None:
    """Each tensor's bytes where the format puts them: in the data section, aligned, within the
    file, none overlapping another (llama.cpp refuses the rest; read as given they were wrong
    weights, silently)."""
    file_size = len(reader.data)
    ranges = []
    for tensor in reader.tensors:
        relative = tensor.data_offset - reader.data_offset
        if relative < 0 or relative % reader.alignment or tensor.data_offset + int(tensor.n_bytes) > file_size:
            raise GGUFError(f"{gguf_path}: tensor {tensor.name}: its data (offset {relative}, {int(tensor.n_bytes)} "
                            f"bytes) is not an aligned range of the file's data section")
        ranges.append((tensor.data_offset, tensor.data_offset + int(tensor.n_bytes), tensor.name))
    ranges.sort()
    for (_, end, name), (start, _, following) in zip(ranges, ranges[1:]):
        if start < end:
            raise GGUFError(f"{gguf_path}: tensors {name} and {following} overlap in the file")


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value pair as Python values (strings, numbers, bools, lists)."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.types:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            value = list(value)
        metadata[key] = value
    return metadata


def hf_config_from_gguf(metadata: dict[str, Any], reader: GGUFReader, gguf_path: Path) -> dict[str, Any]:
    """config.json of the equivalent Hugging Face LlamaForCausalLM."""
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path}: general.architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def required(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise GGUFError(f"{gguf_path}: metadata has no llama.{key}")
        return metadata[f"llama.{key}"]

    if metadata.get("llama.expert_count", 0) > 0:
        raise GGUFError(f"{gguf_path}: llama.expert_count {metadata['llama.expert_count']}: "
                        "mixture-of-experts models are not supported")
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{gguf_path}: tensor rope_freqs.weight (Llama 3.1-style rope scaling) is not supported")
    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = metadata.get("llama.attention.key_length") or metadata.get("llama.rope.dimension_count")
    vocab_size = metadata.get("llama.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
    rope_theta = _float32_as_written(metadata.get("llama.rope.freq_base", 10000.0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata.get("llama.attention.head_count_kv") or num_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": required("context_length"),
        "rms_norm_eps": _float32_as_written(metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        # Both spellings: transformers < 5 reads rope_theta/rope_scaling, 5 reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, gguf_path),
        # Hugging Face's Llama has biases on all four attention projections or none (same for the MLP).
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensor_names,
        # llama.cpp writes no output.weight when the model ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(config["rope_scaling"] or {})}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (token_id := metadata.get(f"tokenizer.ggml.{name}")) is not None:
            config[key] = token_id
    return config


def _check_token_ids(config: dict[str, Any], vocab_size: int) -> None:
    """The special token ids config.json will carry name tokens of the vocabulary: an eos id past
    it never ends a request."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = config.get(key)
        if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < vocab_size):
            raise ModelConfigError(f"tokenizer.ggml.{key.removesuffix('_token_id')}_token_id {token_id!r} is not "
                                   f"a token of the {vocab_size}-token vocabulary")


def _rope_scaling(metadata: dict[str, Any], gguf_path: Path) -> dict[str, Any] | None:
    scaling_type = metadata.get("llama.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata["llama.rope.scaling.factor"])}
    raise GGUFError(f"{gguf_path}: llama.rope.scaling.type {scaling_type!r} is not supported; supported: none, linear")


def check_tensor_types(reader: GGUFReader, gguf_path: Path) -> None:
    unsupported = [tensor for tensor in reader.tensors if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES]
    if unsupported:
        names = ", ".join(f"{tensor.name} ({tensor.tensor_type.name})" for tensor in unsupported[:4])
        raise GGUFError(
            f"{gguf_path}: unsupported quantization type {unsupported[0].tensor_type.name} in tensor(s) {names}; "
            f"supported: {', '.join(tensor_type.name for tensor_type in SUPPORTED_TENSOR_TYPES)}"
        )


def hf_weights_from_gguf(reader: GGUFReader, config: dict[str, Any], gguf_path: Path,
                         tensors: Optional[Sequence] = None) -> dict[str, torch.Tensor]:
    """float32 tensors under Hugging Face's names, each dequantized once, q/k un-permuted: all of
    the file's, or only `tensors` (some of reader.tensors). The caller checked their types."""
    weights = {}
    for tensor in reader.tensors if tensors is None else tensors:
        name = _hf_tensor_name(tensor.name, gguf_path)
        # A copy: F32 tensors dequantize to a read-only view of the mapped file.
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        # llama.cpp permutes q/k biases as it permutes their weights.
        if ".self_attn.q_proj." in name:
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        weights[name] = weight
    return weights


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates halves
    (x0, x_{d/2}), .... Its converter reorders each head's rows from halves to interleaved;
    this puts them back, so the checkpoint runs with Hugging Face's rotate_half.
    """
    rows_per_half = weight.shape[0] // num_heads // 2
    interleaved = weight.reshape(num_heads, rows_per_half, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()


def _hf_tensor_name(gguf_name: str, gguf_path: Path) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise GGUFError(f"{gguf_path}: tensor {gguf_name} has no place in a Llama model")


def _float32_as_written(value: float) -> float:
    """1e-05, not 9.999999747378752e-06: the shortest decimal that rounds to the stored float32."""
    return float(str(np.float32(value)))


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
