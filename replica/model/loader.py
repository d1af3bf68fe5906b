"""Load a local Hugging Face checkpoint directory (config.json + safetensors) into LlamaForCausalLM.

HF's separate q/k/v and gate/up tensors are stacked into the merged projections here. Every way a
directory can be unusable raises ModelLoadError naming the file or checkpoint tensor at fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from replica.attention import get_attention_backend
from replica.model.config import ModelConfig, ModelConfigError, parse_dtype
from replica.model.fused_ops import DEFAULT_FUSED_OPS, get_fused_ops
from replica.model.llama import LlamaForCausalLM, MergedLinear

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
    fused_ops: str = DEFAULT_FUSED_OPS,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by path/config.json and fill it from the directory's safetensors.

    dtype: "float32" | "float16" | "bfloat16" | a torch.dtype; None or "auto" keeps the config's.
    fused_ops: "auto" (Triton on CUDA, inplace elsewhere) | "torch" | "inplace" | "triton" | "compile".
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
    ops = get_fused_ops(fused_ops, device)
    # Built on the meta device: no time or memory spent on random init of weights about to be replaced.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, ops)
    checkpoint = _read_checkpoint(model_dir, device, weights_dtype)
    layout = checkpoint_layout(model)
    _check_against_model(layout, checkpoint, model_dir)
    model.load_state_dict({name: _stack(checkpoint, sources) for name, sources in layout.items()},
                          strict=False, assign=True)
    model.tie_weights()
    # The weights arrived on device in dtype; this moves what construction computed (the rotary table).
    model.to(device=device, dtype=weights_dtype)
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


# (checkpoint tensor name, shape) pairs that make up one model parameter, stacked in this order along dim 0.
TensorSources = list[tuple[str, tuple[int, ...]]]


def checkpoint_layout(model: LlamaForCausalLM) -> dict[str, TensorSources]:
    """Each model parameter's checkpoint tensors: itself, or for a MergedLinear (qkv_proj, gate_up_proj)
    its HF shards, e.g. layers.0.self_attn.qkv_proj.weight <- q_proj.weight, k_proj.weight, v_proj.weight."""
    merged = {name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)}
    layout: dict[str, TensorSources] = {}
    # named_parameters() lists a tied lm_head once, under model.embed_tokens.weight.
    for name, param in model.named_parameters():
        module_name, _, param_kind = name.rpartition(".")
        module = merged.get(module_name)
        if module is None:
            layout[name] = [(name, tuple(param.shape))]
            continue
        parent = module_name.rpartition(".")[0]
        layout[name] = [(f"{parent}.{shard}.{param_kind}", (size, *param.shape[1:]))
                        for shard, size in module.shard_sizes.items()]
    return layout


def _check_against_model(layout: dict[str, TensorSources], checkpoint: dict[str, torch.Tensor],
                         model_dir: Path) -> None:
    """Every tensor the model needs is in the checkpoint, in the shape config.json implies."""
    expected = dict(source for sources in layout.values() for source in sources)
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


def _stack(checkpoint: dict[str, torch.Tensor], sources: TensorSources) -> torch.Tensor:
    """One parameter from its checkpoint tensors; they leave the dict as they are used, so a merged
    parameter's copy never coexists with more than its own shards."""
    if len(sources) == 1:
        return checkpoint.pop(sources[0][0])
    return torch.cat([checkpoint.pop(name) for name, _ in sources], dim=0)
