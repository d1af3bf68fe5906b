"""The Llama-family model, its config, its checkpoint loader and its (fused) elementwise ops.

Names are loaded on first use (PEP 562), so `replica.model.registry` (what `--model` means)
and the model's config import without torch: the ingress and the CLI need those, not the
model.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "replica.model.config",
    "ModelConfigError": "replica.model.config",
    "FusedOps": "replica.model.fused_ops",
    "get_fused_ops": "replica.model.fused_ops",
    "LlamaForCausalLM": "replica.model.llama",
    "OutputRows": "replica.model.llama",
    "ModelLoadError": "replica.model.config",
    "load_model": "replica.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replica.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
