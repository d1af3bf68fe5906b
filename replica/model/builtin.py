"""The built-in default model: a tiny Llama with random weights and a byte-level tokenizer,
written once to a local cache so headroom runs offline with zero downloads.
Its text is meaningless by design (random weights); it exists to exercise the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from replica.model.cache import build_once, default_cache_dir

if TYPE_CHECKING:
    import torch

BUILTIN_MODEL_NAME = "builtin"
# Bump the version whenever the files written below change, so stale caches are not reused.
BUILTIN_MODEL_DIRNAME = "builtin-llama-v2"

NUM_BYTE_TOKENS = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 256, 257, 258
# Padded to a multiple of 64 with reserved special tokens, so every id the model can
# emit has a token (and decodes to nothing when special tokens are skipped).
VOCAB_SIZE = 320
WEIGHT_SEED = 0
# Its chat format: BOS, "<|role|>\ncontent\n" per message, then "<|assistant|>\n" (the
# tokens are plain bytes to this tokenizer; the model is random, so any format would do).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEIGHT_STD = 0.02

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    # Both spellings: transformers < 5 and most loaders read rope_theta, transformers 5
    # reads rope_parameters.
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "initializer_range": WEIGHT_STD,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}


def ensure_builtin_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the built-in model's directory, creating it on first use."""
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(cache_root / BUILTIN_MODEL_DIRNAME, _write_model_files)


def _write_model_files(model_dir: Path) -> None:
    _write_json(model_dir / "config.json", MODEL_CONFIG)
    _write_json(
        model_dir / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID},
    )
    _write_json(
        model_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": MODEL_CONFIG["max_position_embeddings"],
            # Byte-level text must decode exactly as encoded: no space "cleanup".
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    build_byte_level_tokenizer().save(str(model_dir / "tokenizer.json"))
    from safetensors.torch import save_file  # torch only when the model is first written

    save_file(random_llama_weights(), str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def build_byte_level_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255 are the byte values), then <s>, </s>, <pad>, reserved."""
    byte_symbols = bytes_to_unicode()
    vocab = {byte_symbols[byte]: byte for byte in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_reserved = VOCAB_SIZE - NUM_BYTE_TOKENS - 3
    special_tokens = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN] + [f"<|reserved_{i}|>" for i in range(num_reserved)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])
    # Matches add_bos_token in tokenizer_config.json, so every loader adds BOS exactly once.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)]
    )
    return tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizes to)."""
    printable_ranges = [(ord("!"), ord("~")), (ord("¡"), ord("¬")), (ord("®"), ord("ÿ"))]
    symbols = {byte: chr(byte) for first, last in printable_ranges for byte in range(first, last + 1)}
    next_codepoint = 256
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(next_codepoint)
            next_codepoint += 1
    return symbols


def random_llama_weights() -> dict[str, torch.Tensor]:
    """Deterministic random weights under Hugging Face's Llama parameter names."""
    import torch

    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    hidden = MODEL_CONFIG["hidden_size"]
    intermediate = MODEL_CONFIG["intermediate_size"]
    head_dim = MODEL_CONFIG["head_dim"]
    q_dim = MODEL_CONFIG["num_attention_heads"] * head_dim
    kv_dim = MODEL_CONFIG["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * WEIGHT_STD

    # Insertion order fixes the order of draws from the generator, hence the bytes.
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, hidden)}
    for layer in range(MODEL_CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_dim, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_dim)
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(intermediate, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(intermediate, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, intermediate)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(VOCAB_SIZE, hidden)
    return weights
