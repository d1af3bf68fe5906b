"""What a local Hugging Face checkpoint directory must hold, checked without torch: where the
commands take `--model DIR`, before any process starts, so a directory the engine could not load
is one line naming the file (the loader, in the engine core, would fail minutes later in
another process: under Serve, in every replica Serve starts).
"""

from __future__ import annotations

import json
from pathlib import Path

from replica.model.config import ModelConfig, ModelConfigError, ModelLoadError

CONFIG_FILE = "config.json"
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


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files: the shards its index names, else model.safetensors."""
    index_path = model_dir / SHARD_INDEX_FILE
    if index_path.is_file():
        try:
            shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"{index_path}: not a safetensors index (a weight_map of tensor -> file): "
                                 f"{error}") from None
        missing = [name for name in shard_names if not (model_dir / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists missing shard file(s): {', '.join(missing)}")
        return [model_dir / name for name in shard_names]
    single_path = model_dir / SINGLE_WEIGHTS_FILE
    if single_path.is_file():
        return [single_path]
    raise ModelLoadError(f"{model_dir}: missing weights: neither {SINGLE_WEIGHTS_FILE} nor {SHARD_INDEX_FILE}")


def check_checkpoint(model_dir: Path) -> None:
    """ModelLoadError naming the file unless `model_dir` holds a config.json this model implementation
    runs, a tokenizer, and safetensors files whose headers parse and whose tensors the files hold
    (a truncated download). Reads only the config and the headers."""
    read_model_config(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{model_dir}: no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    for path in weight_files(model_dir):
        _check_safetensors(path)


def _check_safetensors(path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header of each tensor's byte range
    (data_offsets, from the end of the header), then the tensors."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            header_length = int.from_bytes(file.read(_SAFETENSORS_HEADER_LENGTH_BYTES), "little")
            if size < _SAFETENSORS_HEADER_LENGTH_BYTES or header_length > size - _SAFETENSORS_HEADER_LENGTH_BYTES:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(file.read(header_length))
        data_end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                       default=0)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes; truncated or corrupt?): "
                             f"{error}") from None
    needed = _SAFETENSORS_HEADER_LENGTH_BYTES + header_length + data_end
    if size < needed:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, its tensors end at byte {needed}")
