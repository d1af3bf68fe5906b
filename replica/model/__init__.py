"""The Llama-family model, its config and its checkpoint loader."""

from replica.model.config import ModelConfig, ModelConfigError
from replica.model.llama import LlamaForCausalLM
from replica.model.loader import ModelLoadError, load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "ModelConfigError", "ModelLoadError", "load_model"]
