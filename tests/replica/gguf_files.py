"""Small synthetic GGUF files for tests, written with the `gguf` package's own writer the way
llama.cpp's converter writes them: Hugging Face Llama weights (q/k rows permuted), any tensor
type, a byte-level BPE tokenizer with a few merges and ChatML special tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.gguf_writer import GGUFValue
from gguf.quants import quantize

from replica.model.builtin import bytes_to_unicode

SHAPE = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=1, context=512)
# K-quant blocks hold 256 values, so every row (the hidden size, the intermediate size) is a multiple of 256.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o r", "e r"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def tokenizer_vocab() -> tuple[list[str], list[int]]:
    """Special tokens first (ids 0-2, as SmolLM2 has them), then the 256 bytes, then each merge's result."""
    symbols = bytes_to_unicode()
    tokens = SPECIAL_TOKENS + [symbols[byte] for byte in range(256)] + [merge.replace(" ", "") for merge in MERGES]
    types = [TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types


SPM_PIECES = ["▁", "t", "h", "e", "a", "n", "d", "i", "s", "o", "r", "▁t", "he", "▁the", "▁a", "nd", "▁and",
              "in", "▁in", "is", "▁is", "or", "er", "▁s", "it", "▁it", "on", "▁on", "x", "y", "z"]


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """Llama 2's layout: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>, then scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + SPM_PIECES
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256 + [
        TokenType.NORMAL] * len(SPM_PIECES)
    # Longer pieces score higher, so they merge first (as in a trained vocabulary); ties broken by order.
    scores = [0.0] * 259 + [len(piece) - index / 100 for index, piece in enumerate(SPM_PIECES)]
    return tokens, types, scores


def hf_llama_weights(vocab_size: int, seed: int = 0, attention_bias: bool = False) -> dict[str, torch.Tensor]:
    """Random float32 weights under Hugging Face's Llama names (tied embeddings: no lm_head)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, intermediate = SHAPE["hidden"], SHAPE["intermediate"]
    q_dim, kv_dim = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden), "model.norm.weight": 1 + normal(hidden)}
    for layer in range(SHAPE["layers"]):
        prefix = f"model.layers.{layer}"
        weights.update({
            f"{prefix}.input_layernorm.weight": 1 + normal(hidden),
            f"{prefix}.post_attention_layernorm.weight": 1 + normal(hidden),
            f"{prefix}.self_attn.q_proj.weight": normal(q_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_dim),
            f"{prefix}.mlp.gate_proj.weight": normal(intermediate, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(intermediate, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, intermediate),
        })
        if attention_bias:
            for projection, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("o", hidden)):
                weights[f"{prefix}.self_attn.{projection}_proj.bias"] = normal(size)
    return weights


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (halves -> interleaved pairs)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{suffix}"


def write_llama_gguf(path: Path, *, weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
                     architecture: str = "llama", pre_tokenizer: str = "smollm", tokenizer_model: str = "gpt2",
                     weights: Optional[dict[str, torch.Tensor]] = None, add_bos: Optional[bool] = False,
                     raw_tensors: Optional[dict[str, tuple[np.ndarray, GGMLQuantizationType]]] = None,
                     metadata: Optional[dict[str, Any]] = None) -> Path:
    """A llama GGUF whose 2-D weights are stored as weight_type (norms stay F32, as llama.cpp keeps them).

    raw_tensors adds tensors exactly as given (bytes and type), e.g. a type we must refuse;
    add_bos None leaves tokenizer.ggml.add_bos_token out (older files), so the default applies;
    metadata replaces keys' values (a value None removes the key; a new value keeps its key's
    type unless given as (value, GGUFValueType)): a file no model could be.
    """
    if tokenizer_model == "llama":
        tokens, token_types, scores = sentencepiece_vocab()
    else:
        (tokens, token_types), scores = tokenizer_vocab(), None
    weights = weights if weights is not None else hf_llama_weights(len(tokens))
    writer = GGUFWriter(str(path), arch=architecture)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(SHAPE["layers"])
    writer.add_context_length(SHAPE["context"])
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_feed_forward_length(SHAPE["intermediate"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(SHAPE["head_dim"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if scores is None:
        writer.add_token_merges(MERGES)
    else:
        writer.add_token_scores(scores)  # SentencePiece files carry scores, not merges
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, weight in weights.items():
        array = weight.numpy()
        if ".q_proj." in hf_name:
            array = llama_cpp_permute(array, SHAPE["heads"])
        elif ".k_proj." in hf_name:
            array = llama_cpp_permute(array, SHAPE["kv_heads"])
        qtype = weight_type if array.ndim == 2 else GGMLQuantizationType.F32
        writer.add_tensor(gguf_name(hf_name), _encode(array, qtype), raw_dtype=qtype)
    for name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    kv_data = writer.kv_data[0]
    for key, value in (metadata or {}).items():
        if value is None:
            del kv_data[key]
        elif isinstance(value, tuple):
            kv_data[key] = GGUFValue(value[0], value[1])
        else:
            kv_data[key] = GGUFValue(value, kv_data[key].type, kv_data[key].sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return array.astype(np.float16)
    try:
        return quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
    except NotImplementedError:
        # The gguf package cannot quantize K-quants; random bytes of the right size are a
        # valid encoding of *some* weights, which is all a dequantization test needs. Bytes
        # below 0x7C keep every float16 scale finite (its exponent never all ones).
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        byte_shape = (*array.shape[:-1], array.shape[-1] // block_size * type_size)
        return np.random.default_rng(0).integers(0, 0x7C, size=byte_shape, dtype=np.uint8)

