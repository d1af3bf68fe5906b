"""Load a local Hugging Face checkpoint directory (config.json + safetensors) into LlamaForCausalLM.

HF's separate q/k/v and gate/up tensors are stacked into the merged projections here. Every way a
directory can be unusable raises ModelLoadError naming the file or checkpoint tensor at fault.
Under tensor parallelism each rank reads only its slices of the sharded tensors (safetensors
reads a slice without the rest), so no rank holds the whole model at any time.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from safetensors import safe_open

from replica.attention import get_attention_backend
from replica.model.checkpoint import check_layer_count, read_model_config, weight_files
from replica.model.config import ModelConfig, ModelConfigError, ModelLoadError, parse_dtype
from replica.config import DEFAULT_FUSED_OPS
from replica.model.fused_ops import get_fused_ops
from replica.model.llama import LlamaForCausalLM, MergedLinear
from replica.parallel.group import NO_TENSOR_PARALLEL, TensorParallel, kv_head_start, shard_config

logger = logging.getLogger(__name__)



def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
    fused_ops: str = DEFAULT_FUSED_OPS,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by path/config.json and fill it from the directory's safetensors.
    Under tensor parallelism, this rank's shard of it, and the config it was built from (its
    share of the heads and MLP width; shard_config raises if tp.size does not divide them).

    dtype: "float32" | "float16" | "bfloat16" | a torch.dtype; None or "auto" keeps the config's.
    fused_ops: "auto" (Triton on CUDA, inplace elsewhere) | "torch" | "inplace" | "triton" | "compile".
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    cfg = read_model_config(model_dir)
    try:
        weights_dtype = cfg.torch_dtype if dtype in (None, "auto") else parse_dtype(dtype)
    except ModelConfigError as err:
        raise ModelLoadError(str(err)) from err
    device = torch.device(device)

    backend = get_attention_backend(attention_backend, device)
    ops = get_fused_ops(fused_ops, device)
    rank_cfg = shard_config(cfg, tp.size)
    with _Checkpoint(model_dir, device, weights_dtype) as checkpoint:
        # Before the model is built for them: a config's layer count the weights do not hold.
        check_layer_count(checkpoint.shapes, cfg.num_hidden_layers, model_dir)
        # Built on the meta device: no time or memory spent on random init of weights about to be replaced.
        with torch.device("meta"):
            model = LlamaForCausalLM(rank_cfg, backend, ops, tp)
            whole_model = LlamaForCausalLM(cfg, backend, ops) if tp.size > 1 else model
        layout = checkpoint_layout(model, whole_model)
        _check_against_model(layout, checkpoint.shapes, model_dir)
        model.load_state_dict({name: _stack(checkpoint, sources) for name, sources in layout.items()},
                              strict=False, assign=True)
    model.tie_weights()
    # The weights arrived on device in dtype; this moves what construction computed (the rotary table).
    model.to(device=device, dtype=weights_dtype)
    model.requires_grad_(False)
    if device.type == "cpu":
        model.store_linear_weights_input_major()
    model.eval()
    logger.info("loaded %s from %s: %d layers, %s on %s%s", cfg.architecture, model_dir, cfg.num_hidden_layers,
                weights_dtype, device, f" (tensor-parallel rank {tp.rank} of {tp.size})" if tp.size > 1 else "")
    return model, rank_cfg


class _Checkpoint:
    """The directory's safetensors files, open: every tensor's shape, and reads of a whole
    tensor or of one slice of it, converted one tensor at a time so peak memory stays near
    the (shard of the) model's own size."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype):
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self._files = ExitStack()
        self._file_of: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __enter__(self) -> "_Checkpoint":
        for weights_path in weight_files(self.model_dir):
            try:
                weights = self._files.enter_context(safe_open(weights_path, framework="pt", device=str(self.device)))
            except Exception as error:  # noqa: BLE001 - safetensors' own error types vary
                self._files.close()
                raise ModelLoadError(f"{weights_path}: not a safetensors file: {error}") from None
            for name in weights.keys():
                self._file_of[name] = weights
                self.shapes[name] = tuple(weights.get_slice(name).get_shape())
        return self

    def __exit__(self, *exc_info) -> None:
        self._files.close()

    def read(self, source: "TensorSource") -> torch.Tensor:
        weights = self._file_of[source.name]
        if source.shard is None:
            tensor = weights.get_tensor(source.name)
        else:
            dim, start, stop = source.shard
            whole = weights.get_slice(source.name)
            # A vocab-parallel block may reach past the vocabulary (padding): only real rows are read.
            real_stop = min(stop, source.shape[dim])
            real_start = min(start, real_stop)
            tensor = whole[real_start:real_stop] if dim == 0 else whole[:, real_start:real_stop]
            if real_stop - real_start < stop - start:
                padding = [0, 0] * (tensor.dim() - 1 - dim) + [0, stop - start - (real_stop - real_start)]
                tensor = torch.nn.functional.pad(tensor, padding)  # zero rows, never embedded nor sampled
        return tensor.to(device=self.device, dtype=self.dtype)


class TensorSource(NamedTuple):
    """A checkpoint tensor (its whole shape) one model parameter is made of; `shard` =
    (dim, start, stop) when the parameter holds only that slice of it (tensor parallelism)."""

    name: str
    shape: tuple[int, ...]
    shard: Optional[tuple[int, int, int]] = None


# The checkpoint tensors that make up one model parameter, stacked in this order along dim 0.
TensorSources = list[TensorSource]


def checkpoint_layout(model: LlamaForCausalLM, whole_model: Optional[LlamaForCausalLM] = None
                      ) -> dict[str, TensorSources]:
    """Each model parameter's checkpoint tensors: itself, or for a MergedLinear (qkv_proj, gate_up_proj)
    its HF shards, e.g. layers.0.self_attn.qkv_proj.weight <- q_proj.weight, k_proj.weight, v_proj.weight.
    For a tensor-parallel rank's model, whole_model (the same model at size 1, on the meta device)
    gives the checkpoint's shapes, and a parameter smaller than its tensor takes the rank's slice:
    block `rank` of the sharded dimension (the vocabulary's last block may reach past the
    tensor: the padding, zero), except K/V projections that replicate a KV head."""
    whole_model = whole_model if whole_model is not None else model
    tp = model.tp
    merged = {name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)}
    whole_merged = {name: module for name, module in whole_model.named_modules() if isinstance(module, MergedLinear)}
    whole_params = dict(whole_model.named_parameters())
    kv_start = kv_head_start(whole_model.cfg, tp.rank, tp.size) * model.cfg.head_dim
    layout: dict[str, TensorSources] = {}
    # named_parameters() lists a tied lm_head once, under model.embed_tokens.weight.
    for name, param in model.named_parameters():
        module_name, _, param_kind = name.rpartition(".")
        module = merged.get(module_name)
        if module is None:
            whole_shape = tuple(whole_params[name].shape)
            shard = None
            for dim, (size, whole_size) in enumerate(zip(param.shape, whole_shape)):
                if size != whole_size:
                    shard = (dim, tp.rank * size, (tp.rank + 1) * size)
            layout[name] = [TensorSource(name, whole_shape, shard)]
            continue
        parent = module_name.rpartition(".")[0]
        sources = []
        for shard_name, size in module.shard_sizes.items():
            whole_size = whole_merged[module_name].shard_sizes[shard_name]
            start = kv_start if shard_name in ("k_proj", "v_proj") else tp.rank * size
            sources.append(TensorSource(f"{parent}.{shard_name}.{param_kind}", (whole_size, *param.shape[1:]),
                                        None if size == whole_size else (0, start, start + size)))
        layout[name] = sources
    return layout


def _check_against_model(layout: dict[str, TensorSources], shapes: dict[str, tuple[int, ...]],
                         model_dir: Path) -> None:
    """Every tensor the model needs is in the checkpoint, in the shape config.json implies."""
    expected = {source.name: source.shape for sources in layout.values() for source in sources}
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensor(s): {', '.join(missing)}")
    for name, shape in expected.items():
        actual = shapes[name]
        if actual != shape:
            raise ModelLoadError(
                f"{model_dir}: tensor {name} has shape {list(actual)}, but config.json implies {list(shape)}"
            )
    # A tied checkpoint may still carry lm_head.weight; HF also drops stale rotary buffers. Neither matters.
    unused = [name for name in shapes if name not in expected
              and name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq")]
    if unused:
        logger.warning("%s: ignoring %d tensor(s) the model has no place for: %s", model_dir, len(unused),
                       ", ".join(unused[:8]))


def _stack(checkpoint: _Checkpoint, sources: TensorSources) -> torch.Tensor:
    """One parameter from its checkpoint tensors (or their slices), read as it is built, so a
    merged parameter's copy never coexists with more than its own shards."""
    if len(sources) == 1:
        return checkpoint.read(sources[0])
    return torch.cat([checkpoint.read(source) for source in sources], dim=0)
