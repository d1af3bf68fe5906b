"""Load a local Hugging Face checkpoint directory (config.json + safetensors) into LlamaForCausalLM.

Every way a directory can be unusable raises ModelLoadError naming the file or tensor at fault,
before any weights are trusted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from replica.attention import get_attention_backend
from replica.model.config import ModelConfig, ModelConfigError, parse_dtype
from replica.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor at fault."""


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by path/config.json and fill it from the directory's safetensors.

    dtype: "float32" | "float16" | "bfloat16" | a torch.dtype; None or "auto" keeps the config's.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    cfg = read_model_config(model_dir)
    try:
        weights_dtype = cfg.dtype if dtype in (None, "auto") else parse_dtype(dtype)
    except ModelConfigError as err:
        raise ModelLoadError(str(err)) from err
    device = torch.device(device)

    backend = get_attention_backend(attention_backend, device)
    # Built on the meta device: no time or memory spent on random init of weights about to be replaced.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend)
    checkpoint = _read_checkpoint(model_dir, device, weights_dtype)
    expected_shapes = _check_against_model(model, checkpoint, model_dir)
    model.load_state_dict({name: checkpoint[name] for name in expected_shapes}, strict=False, assign=True)
    model.tie_weights()
    model.requires_grad_(False)
    model.eval()
    logger.info("loaded %s from %s: %d layers, %s on %s", cfg.architecture, model_dir, cfg.num_hidden_layers,
                weights_dtype, device)
    return model, cfg


def read_model_config(model_dir: Path) -> ModelConfig:
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text())
        return ModelConfig.from_hf_config(raw)
    except (json.JSONDecodeError, ModelConfigError) as err:
        raise ModelLoadError(f"{config_path}: {err}") from err


def _weight_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / SHARD_INDEX_FILE
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        missing = [name for name in shard_names if not (model_dir / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists missing shard file(s): {', '.join(missing)}")
        return [model_dir / name for name in shard_names]
    single_path = model_dir / SINGLE_WEIGHTS_FILE
    if single_path.is_file():
        return [single_path]
    raise ModelLoadError(f"{model_dir}: missing weights: neither {SINGLE_WEIGHTS_FILE} nor {SHARD_INDEX_FILE}")


def _read_checkpoint(model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for weights_path in _weight_files(model_dir):
        with safe_open(weights_path, framework="pt", device=str(device)) as weights:
            for name in weights.keys():
                # Converted one tensor at a time, so peak memory stays near the model's own size.
                tensors[name] = weights.get_tensor(name).to(dtype)
    return tensors


def _check_against_model(
    model: LlamaForCausalLM, checkpoint: dict[str, torch.Tensor], model_dir: Path
) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes, after checking the checkpoint has each one in that shape."""
    # named_parameters() lists a tied lm_head once, under model.embed_tokens.weight.
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    missing = [name for name in expected if name not in checkpoint]
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensor(s): {', '.join(missing)}")
    for name, shape in expected.items():
        actual = tuple(checkpoint[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"{model_dir}: tensor {name} has shape {list(actual)}, but config.json implies {list(shape)}"
            )
    # A tied checkpoint may still carry lm_head.weight; HF also drops stale rotary buffers. Neither matters.
    unused = [name for name in checkpoint if name not in expected
              and name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq")]
    if unused:
        logger.warning("%s: ignoring %d tensor(s) the model has no place for: %s", model_dir, len(unused),
                       ", ".join(unused[:8]))
    return expected
