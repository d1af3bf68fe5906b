"""The Llama-family model, its config, its checkpoint loader and its (fused) elementwise ops."""

from replica.model.config import ModelConfig, ModelConfigError
from replica.model.fused_ops import DEFAULT_FUSED_OPS, FUSED_OPS_NAMES, FusedOps, get_fused_ops
from replica.model.llama import LlamaForCausalLM, OutputRows
from replica.model.loader import ModelLoadError, load_model

__all__ = [
    "DEFAULT_FUSED_OPS",
    "FUSED_OPS_NAMES",
    "FusedOps",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "OutputRows",
    "get_fused_ops",
    "load_model",
]
