"""What a local Hugging Face checkpoint directory must hold, checked without torch: where the
commands take `--model DIR`, before any process starts, so a directory the engine could not load
is one line naming the file (the loader, in the engine core, would fail minutes later in
another process: under Serve, in every replica Serve starts).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterable, Optional

from replica.core.request import MODEL_DEFAULT_FIELDS, SamplingDefaults, SamplingParams
from replica.errors import InvalidRequestError
from replica.model.config import ModelConfig, ModelConfigError, ModelLoadError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' GenerationConfig defaults for the fields sampling_defaults reads.
HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
# tokenizer.json, or the files a slow tokenizer is converted from (replica/text/tokenizer.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_SAFETENSORS_HEADER_LENGTH_BYTES = 8


def read_model_config(model_dir: Path) -> ModelConfig:
    """The directory's config.json as a ModelConfig; ModelLoadError naming the file otherwise."""
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelLoadError(f"{config_path}: not readable JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: not a JSON object")
    try:
        return ModelConfig.from_hf_config(raw)
    except (ModelConfigError, KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{config_path}: {error}") from None


def generation_eos_ids(model_dir: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids generation_config.json names (HF's generate() stops on them too:
    an instruct model's end-of-turn token may be listed only there); () without a usable one."""
    try:
        eos = json.loads((model_dir / GENERATION_CONFIG_FILE).read_text()).get("eos_token_id")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(token_id for token_id in ids
                 if isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < vocab_size)


def sampling_defaults(model_dir: Path, generation_config: str) -> SamplingDefaults:
    """What the model's requests leave unset takes (EngineConfig.generation_config): under "auto",
    the temperature, top_p, top_k, min_p and repetition_penalty generation_config.json gives, and
    its max_new_tokens as an unset max_tokens' cap, as vLLM's --generation-config auto reads them;
    under "none", or with no such file, SamplingParams' own defaults.

    `do_sample` is not read, as vLLM does not read it: a file with `do_sample: false` beside a
    temperature means that temperature (HF's generate() would be greedy), and one that gives no
    temperature means 1.0. A file that does not read, or a value no request could have (a string,
    a temperature below 0, a top_p of 2), is a ModelLoadError naming the file and the key: every
    request that left the field unset would otherwise be refused for a value it never sent.
    """
    if generation_config == "none":
        return SamplingDefaults()
    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults()
    ignore_it = "(or serve with generation_config: none to ignore the file)"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelLoadError(f"{path}: not readable JSON: {error} {ignore_it}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object {ignore_it}")
    # A null is unset, as vLLM reads it; so is a value equal to HF's own default (vLLM reads the
    # file through transformers' to_diff_dict(), which drops those: an explicit top_k of 50 is
    # not a recommendation, only HF's default written out).
    given = {name: raw[name] for name in MODEL_DEFAULT_FIELDS
             if raw.get(name) is not None
             and (isinstance(raw[name], bool) or raw[name] != HF_GENERATION_DEFAULTS.get(name))}
    max_new_tokens = raw.get("max_new_tokens")
    for name, value in (*given.items(), ("max_new_tokens", max_new_tokens)):
        integer = name in ("top_k", "max_new_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))):
            raise ModelLoadError(f"{path}: {name} {json.dumps(value)}: must be {'an integer' if integer else 'a number'} "
                                 f"{ignore_it}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ModelLoadError(f"{path}: max_new_tokens {max_new_tokens}: must be >= 1 {ignore_it}")
    params = SamplingParams(**given)
    try:  # the checks a request's own values get
        params.validate(prompt_len=0, max_model_len=params.max_tokens)
    except InvalidRequestError as error:
        raise ModelLoadError(f"{path}: {error.field} {given[error.field]}: {error.message} {ignore_it}") from None
    return SamplingDefaults(params, max_new_tokens)


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files: model.safetensors, else the shards its index names
    (HF's order: a directory holding both loads the single file)."""
    single_path = model_dir / SINGLE_WEIGHTS_FILE
    if single_path.is_file():
        return [single_path]
    index_path = model_dir / SHARD_INDEX_FILE
    if index_path.is_file():
        try:
            shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
            if not all(isinstance(name, str) for name in shard_names):
                raise ValueError("a file name that is not a string")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"{index_path}: not a safetensors index (a weight_map of tensor -> file): "
                                 f"{error}") from None
        missing = [name for name in shard_names if not (model_dir / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists missing shard file(s): {', '.join(missing)}")
        return [model_dir / name for name in shard_names]
    raise ModelLoadError(f"{model_dir}: missing weights: neither {SINGLE_WEIGHTS_FILE} nor {SHARD_INDEX_FILE}")


def check_checkpoint(model_dir: Path, chat_template: Optional[str] = None) -> None:
    """ModelLoadError naming the file unless `model_dir` holds a config.json this model implementation
    runs, a tokenizer that loads, and safetensors files whose headers describe each tensor
    consistently, whose tensors the files hold (a truncated download) and whose layers are the
    config's. Reads the config, the tokenizer's files and the headers, not the weights.
    chat_template: the server's (--chat-template), which replaces the checkpoint's: then the
    checkpoint's own is not checked (a broken one is why a user gives another)."""
    config = read_model_config(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{model_dir}: no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    from replica.text.tokenizer import Tokenizer, TokenizerLoadError

    try:
        Tokenizer.from_pretrained(model_dir, chat_template=chat_template)
    except TokenizerLoadError as error:
        raise ModelLoadError(str(error)) from None
    names: list[str] = []
    for path in weight_files(model_dir):
        names += _check_safetensors(path)
    check_layer_count(names, config.num_hidden_layers, model_dir)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def check_layer_count(tensor_names: Iterable[str], num_hidden_layers: int, where: Path,
                      field: str = "config.json's num_hidden_layers") -> None:
    """ModelLoadError unless the checkpoint's layers are layers 0 to num_hidden_layers - 1: a
    config claiming fewer served a truncated model (the rest ignored), more a model built
    before its weights were found missing (2^40 layers never finished building)."""
    layers = {int(match.group(1)) for name in tensor_names if (match := _LAYER_NAME.match(name))}
    consecutive = not layers or (min(layers) == 0 and max(layers) == len(layers) - 1)
    if len(layers) != num_hidden_layers or not consecutive:  # (no set of range(2^40) built to compare)
        found = f"layers 0 to {max(layers)}" if layers and consecutive else (
            f"{len(layers)} layer indices" if layers else "no layers")
        raise ModelLoadError(f"{where}: {field} is {num_hidden_layers}, the weights hold {found}")


# Bytes per element of each safetensors dtype.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_safetensors(path: Path) -> list[str]:
    """A safetensors file is an 8-byte header length, a JSON header of each tensor's dtype,
    shape and byte range (data_offsets, from the end of the header), then the tensors. Returns
    the tensors' names."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            header_length = int.from_bytes(file.read(_SAFETENSORS_HEADER_LENGTH_BYTES), "little")
            if size < _SAFETENSORS_HEADER_LENGTH_BYTES or header_length > size - _SAFETENSORS_HEADER_LENGTH_BYTES:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(file.read(header_length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        data_end = max((_tensor_end(name, entry) for name, entry in tensors.items()), default=0)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes; truncated or corrupt?): "
                             f"{error}") from None
    needed = _SAFETENSORS_HEADER_LENGTH_BYTES + header_length + data_end
    if size < needed:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, its tensors end at byte {needed}")
    return list(tensors)


def _tensor_end(name: str, entry: dict) -> int:
    """Where the tensor's bytes end; ValueError unless its dtype, shape and byte range agree."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0
                                              for dim in shape):
        raise ValueError(f"tensor {name}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0 for offset in offsets)):
        raise ValueError(f"tensor {name}: data_offsets {offsets!r} is not a [begin, end] byte range")
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ValueError(f"tensor {name}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
    return offsets[1]
