"""Paged attention backends behind one interface, and the choice between them.

The Triton backend is imported only when chosen, so CPU installs without Triton still work.
"""

from __future__ import annotations

import logging

import torch

from replica.attention.base import AttentionBackend, AttentionMetadata, allocate_kv_cache, block_table_width
from replica.config import ATTENTION_BACKEND_NAMES

logger = logging.getLogger(__name__)



def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called `name`; "auto" picks Triton on CUDA and the torch reference elsewhere."""
    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(ATTENTION_BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from replica.attention.triton_backend import TritonAttentionBackend

        backend: AttentionBackend = TritonAttentionBackend()
    else:
        from replica.attention.torch_ref import TorchAttentionBackend

        backend = TorchAttentionBackend()
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend


__all__ = [
    "ATTENTION_BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "allocate_kv_cache",
    "block_table_width",
    "get_attention_backend",
]
