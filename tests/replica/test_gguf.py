"""GGUF conversion on small synthetic files written by the `gguf` package's own writer: every
supported tensor type converts exactly as transformers' own GGUF loader converts it (llama.cpp's
q/k permutation undone),
the config and tokenizer come from the metadata, the conversion is cached, and a truncated
file, another architecture or an unsupported quantization is an error naming it."""

from __future__ import annotations

import json
import os
import time
import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType
from safetensors.torch import load_file

from gguf_files import (
    CHAT_TEMPLATE, SHAPE, hf_llama_weights, llama_cpp_permute, sentencepiece_vocab, tokenizer_vocab, write_llama_gguf,
)
from replica.model import gguf as gguf_module
from replica.model.gguf import SUPPORTED_TENSOR_TYPES, GGUFError, convert_gguf, unpermute_rotary_rows
from replica.model.checkpoint import check_checkpoint
from replica.model.config import ModelLoadError
from replica.model.gguf_tokenizer import GGUFTokenizerError
from replica.model.loader import checkpoint_layout, load_model
from replica.parallel.group import TensorParallel
from replica.text.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


@pytest.fixture(scope="module")
def f32_dir(f32_gguf, tmp_path_factory):
    return convert_gguf(f32_gguf, tmp_path_factory.mktemp("cache"))


def test_f32_weights_come_back_exactly_with_q_and_k_rows_unpermuted(f32_dir):
    original = hf_llama_weights(len(tokenizer_vocab()[0]))
    converted = load_file(f32_dir / "model.safetensors")
    assert set(converted) == set(original)
    for name, weight in original.items():
        assert torch.equal(converted[name], weight), name


def test_attention_biases_come_back_unpermuted_and_switch_attention_bias_on(tmp_path):
    original = hf_llama_weights(len(tokenizer_vocab()[0]), attention_bias=True)
    gguf_path = write_llama_gguf(tmp_path / "bias.gguf", weights=original)
    model_dir = convert_gguf(gguf_path, tmp_path / "cache")
    converted = load_file(model_dir / "model.safetensors")
    for name, weight in original.items():
        assert torch.equal(converted[name], weight), name
    assert json.loads((model_dir / "config.json").read_text())["attention_bias"] is True
    load_model(model_dir, dtype="float32")  # every bias finds its parameter


def test_unpermute_inverts_llama_cpps_permutation_for_query_and_grouped_key_heads():
    for num_heads in (4, 2, 1):
        weight = torch.arange(num_heads * 64 * 3, dtype=torch.float32).reshape(num_heads * 64, 3)
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(unpermute_rotary_rows(permuted, num_heads), weight)


def test_config_comes_from_the_metadata(f32_dir):
    config = json.loads((f32_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        SHAPE["hidden"], SHAPE["intermediate"], SHAPE["layers"])
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"])
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (
        100000.0, 1e-5, SHAPE["context"])
    assert config["tie_word_embeddings"] is True  # no output.weight in the file
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (len(tokenizer_vocab()[0]), 1, 2)


def test_the_converted_directory_loads_in_the_engines_loader_and_in_transformers(f32_dir):
    model, config = load_model(f32_dir, dtype="float32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.float32)
    theirs = reference.state_dict()
    # Merged projections (qkv_proj, gate_up_proj) are HF's shards stacked along dim 0, in layout order.
    layout = checkpoint_layout(model)
    for name, weight in model.named_parameters():
        shards = [theirs[source.name] for source in layout[name]]
        assert torch.equal(weight, torch.cat(shards, dim=0)), name
    assert config.tie_word_embeddings


def test_tokenizer_files_carry_the_special_tokens_and_the_chat_template(f32_dir):
    tokenizer = Tokenizer.from_pretrained(f32_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("<|im_start|>user\nthe<|im_end|>", add_special_tokens=False)[0] == 1
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


TEXTS = ["the theory in the north", "Ünïcödé 😀 and 日本語", "x = [1, 22, 333]\n\tif a or b: return",
         "  spaces   and\n\nnewlines ", "<|im_start|>user\nthe end<|im_end|>"]


@pytest.mark.parametrize("pre_tokenizer", ["default", "smollm", "llama-bpe"])
def test_tokenizer_equals_transformers_gguf_tokenizer_for_each_pre_tokenizer(tmp_path, pre_tokenizer):
    gguf_path = write_llama_gguf(tmp_path / f"tok-{pre_tokenizer}.gguf", pre_tokenizer=pre_tokenizer)
    ours = Tokenizer.from_pretrained(convert_gguf(gguf_path, tmp_path / "cache"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    for text in TEXTS:
        expected = reference.encode(text)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected), text


SPM_TEXTS = ["the and is it", "  in the  end", "Ünïcödé 😀 unknown characters fall back to bytes",
             "<s>the</s> and", "x\ny\tz"]


def test_a_sentencepiece_tokenizer_equals_transformers_gguf_tokenizer(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "spm.gguf", tokenizer_model="llama", pre_tokenizer="default", add_bos=None)
    ours = Tokenizer.from_pretrained(convert_gguf(gguf_path, tmp_path / "cache"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    for text in SPM_TEXTS:
        expected = reference.encode(text)
        assert expected[0] == 1  # BOS: llama.cpp adds it to SentencePiece vocabularies by default
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True), text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected), text


def test_a_sentencepiece_stream_of_byte_tokens_is_released_as_its_full_decode(tmp_path):
    """SentencePiece's byte fallback turns a broken run of bytes into one replacement character
    per byte, split or not: a held run past 16 tokens (here 17 byte tokens of "你" x 6 in one
    step, its last character one byte short) must not be released split (sixteen replacement
    characters went out before the character completed, in a reviewer's probe of a first try)."""
    gguf_path = write_llama_gguf(tmp_path / "spm.gguf", tokenizer_model="llama", pre_tokenizer="default", add_bos=None)
    ours = Tokenizer.from_pretrained(convert_gguf(gguf_path, tmp_path / "cache"))
    assert not ours.byte_level
    byte_token = {token: index for index, token in enumerate(sentencepiece_vocab()[0])}
    ids = [byte_token[f"<0x{byte:02X}>"] for byte in ("你" * 6).encode()]
    assert ours.decode(ids) == "你" * 6
    detokenizer = IncrementalDetokenizer(ours)
    deltas = [detokenizer.add_tokens(ids[:17]), detokenizer.add_tokens(ids[17:])]
    assert deltas[0] == "" and "".join(deltas) + detokenizer.flush() == "你" * 6


KNOWN_GOOD_ENCODINGS = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("weight_type", [T.F32] + KNOWN_GOOD_ENCODINGS + K_QUANTS, ids=lambda t: t.name)
def test_each_supported_type_converts_exactly_as_transformers_own_gguf_loading(tmp_path, weight_type):
    """transformers dequantizes and un-permutes GGUF weights with its own code: an independent oracle."""
    gguf_path = write_llama_gguf(tmp_path / f"tiny-{weight_type.name}.gguf", weight_type=weight_type)
    converted = load_file(convert_gguf(gguf_path, tmp_path / "cache") / "model.safetensors")
    assert {tensor.tensor_type for tensor in GGUFReader(gguf_path).tensors} == {weight_type, T.F32}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).state_dict()
    original = hf_llama_weights(len(tokenizer_vocab()[0]))
    assert set(converted) == set(reference) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for hf_name, weight in converted.items():
        assert torch.equal(weight, reference[hf_name]), hf_name
        if weight_type in KNOWN_GOOD_ENCODINGS:  # real quantized weights: close to the originals
            error = (weight - original[hf_name]).norm() / original[hf_name].norm()
            assert error < 0.2, (hf_name, error)


def test_every_documented_type_is_supported():
    assert set(KNOWN_GOOD_ENCODINGS + K_QUANTS + [T.F32]) == set(SUPPORTED_TENSOR_TYPES)


def test_second_conversion_reuses_the_cache_and_a_changed_file_gets_its_own_entry(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = convert_gguf(gguf_path, cache)
    written_at = (first / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert convert_gguf(gguf_path, cache) == first
    assert time.monotonic() - started < 1.0
    assert (first / "model.safetensors").stat().st_mtime_ns == written_at
    changed = write_llama_gguf(tmp_path / "tiny.gguf", weights=hf_llama_weights(len(tokenizer_vocab()[0]), seed=1))
    second = convert_gguf(changed, cache)
    assert second != first and sorted(path.name for path in second.parent.iterdir()) == sorted([first.name,
                                                                                                   second.name])


def test_a_model_past_the_shard_bound_is_converted_one_shard_at_a_time_and_each_rank_reads_its_slices(
        tmp_path, f32_gguf, f32_dir, monkeypatch):
    """Conversion holds one shard, never the whole model (a 70B GGUF is 280 GB as float32): each
    shard written is within the bound, and when it is written every tensor of the shards before
    it is already freed; the shards and their index load as the one-file conversion does, whole
    and as rank 1 of 2's slices. (Weak references, not a count of the process's live tensors:
    in a full test run other threads' tensors would count too.)"""
    bound = 600_000  # bytes: the tiny model's 2.6 MB of float32 in five shards
    model_bytes = sum(weight.numel() * 4 for weight in hf_llama_weights(len(tokenizer_vocab()[0])).values())
    written: list[tuple[int, int]] = []  # per shard: (its bytes, earlier shards' tensors still alive)
    earlier: list[weakref.ref] = []
    save_file = gguf_module.save_file

    def save_and_measure(weights, path, metadata=None):
        shard_bytes = sum(weight.numel() * weight.element_size() for weight in weights.values())
        written.append((shard_bytes, sum(1 for ref in earlier if ref() is not None)))
        save_file(weights, path, metadata=metadata)
        earlier.extend(weakref.ref(weight) for weight in weights.values())

    monkeypatch.setattr(gguf_module, "save_file", save_and_measure)
    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    gguf_module.write_hf_checkpoint(f32_gguf, model_dir, max_shard_bytes=bound)
    shard_files = sorted(path.name for path in model_dir.glob("model-*.safetensors"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(shard_files) == len(written) >= 4 and not (model_dir / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shard_files and index["metadata"]["total_size"] == model_bytes
    assert all(0 < shard_bytes <= bound for shard_bytes, _ in written) and bound < model_bytes / 4, written
    assert all(alive == 0 for _, alive in written), written  # no shard outlives its write
    for tp in (None, TensorParallel(rank=1, size=2)):
        kwargs = {} if tp is None else {"tp": tp}
        ours, _ = load_model(model_dir, dtype="float32", **kwargs)
        theirs, _ = load_model(f32_dir, dtype="float32", **kwargs)
        ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert ours_params.keys() == theirs_params.keys()
        assert all(torch.equal(ours_params[name], theirs_params[name]) for name in ours_params)


# ---- errors -----------------------------------------------------------------------------
def test_a_truncated_file_is_an_error_naming_the_file(tmp_path, f32_gguf):
    truncated = tmp_path / "truncated.gguf"
    data = f32_gguf.read_bytes()
    truncated.write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(GGUFError, match=r"truncated\.gguf: not a readable GGUF file .*truncated or corrupt"):
        convert_gguf(truncated, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_file_cut_inside_its_header_is_an_error_too(tmp_path, f32_gguf):
    truncated = tmp_path / "header.gguf"
    truncated.write_bytes(f32_gguf.read_bytes()[:300])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        convert_gguf(truncated, tmp_path / "cache")


def test_another_architecture_is_an_error_naming_it(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "qwen.gguf", architecture="qwen2")
    with pytest.raises(GGUFError, match="general.architecture 'qwen2' is not supported; supported: llama"):
        convert_gguf(gguf_path, tmp_path / "cache")


def test_an_unsupported_quantization_is_an_error_naming_it_and_the_tensor(tmp_path):
    q8_k_bytes = np.zeros((4, 292), dtype=np.uint8)  # one Q8_K block (256 values) per row
    gguf_path = write_llama_gguf(tmp_path / "q8k.gguf", raw_tensors={"blk.0.attn_q.bias": (q8_k_bytes, T.Q8_K)})
    with pytest.raises(GGUFError, match=r"unsupported quantization type Q8_K in tensor\(s\) blk.0.attn_q.bias"):
        convert_gguf(gguf_path, tmp_path / "cache")


def test_a_tensor_a_llama_has_no_place_for_is_an_error_naming_it(tmp_path):
    router = np.zeros((8, SHAPE["hidden"]), dtype=np.float32)  # a mixture-of-experts router
    gguf_path = write_llama_gguf(tmp_path / "extra.gguf", raw_tensors={"blk.0.ffn_gate_inp.weight": (router, T.F32)})
    with pytest.raises(GGUFError, match="tensor blk.0.ffn_gate_inp.weight has no place in a Llama model"):
        convert_gguf(gguf_path, tmp_path / "cache")


@pytest.mark.parametrize("tokenizer_model, pre_tokenizer, message", [
    ("t5", "default", "tokenizer.ggml.model 't5' is not supported"),
    ("gpt2", "deepseek-coder", "tokenizer.ggml.pre 'deepseek-coder' is not supported"),
])
def test_an_unsupported_tokenizer_is_an_error_naming_it(tmp_path, tokenizer_model, pre_tokenizer, message):
    gguf_path = write_llama_gguf(tmp_path / "tok.gguf", tokenizer_model=tokenizer_model, pre_tokenizer=pre_tokenizer)
    with pytest.raises(GGUFTokenizerError, match=message):
        convert_gguf(gguf_path, tmp_path / "cache")


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nowhere.gguf", tmp_path / "cache")
    assert not os.path.exists(tmp_path / "cache")


def test_a_gguf_template_that_does_not_compile_converts_and_is_replaced_by_the_servers(tmp_path, caplog):
    # It was a conversion error, before any --chat-template could replace it (vLLM's flag does).
    gguf_path = write_llama_gguf(tmp_path / "bad-template.gguf",
                                 metadata={"tokenizer.chat_template": ("{% for m in messages %}", GGUFValueType.STRING)})
    model_dir = convert_gguf(gguf_path, tmp_path / "cache")
    assert f"{gguf_path}: tokenizer.chat_template: the checkpoint's chat template does not compile" in caplog.text
    with pytest.raises(ModelLoadError, match="does not compile.*--chat-template FILE replaces it"):
        check_checkpoint(model_dir)
    check_checkpoint(model_dir, chat_template="{{ messages[0]['content'] }}")


@pytest.mark.parametrize("metadata, message", [
    # Each was a traceback from deep in the conversion or the model's construction, a model
    # built without end, or one that loaded and answered NaN or never stopped (helper-52's fuzzing).
    ({"llama.attention.head_count": 0}, "num_attention_heads 0: must be an integer >= 1"),
    ({"llama.block_count": 5}, "llama.block_count is 5, the weights hold layers 0 to 0"),
    ({"llama.block_count": (2 ** 40, GGUFValueType.UINT64)}, "llama.block_count is 1099511627776, the weights hold layers 0 to 0"),
    ({"tokenizer.ggml.eos_token_id": 99999}, "eos_token_id 99999: not token ids of the vocabulary"),
    ({"llama.rope.freq_base": 0.0}, "rope_theta 0.0: must be a finite number > 0"),
    ({"tokenizer.chat_template": (5, GGUFValueType.UINT32)}, "tokenizer.chat_template is not a string"),
    ({"llama.rope.scaling.type": ("linear", GGUFValueType.STRING)}, "malformed metadata: KeyError: 'llama.rope.scaling.factor'"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens: missing, or not a list of strings"),
])
def test_metadata_no_model_could_be_is_one_error_naming_the_file_and_what(tmp_path, metadata, message):
    gguf_path = write_llama_gguf(tmp_path / "bad.gguf", metadata=metadata)
    with pytest.raises(ModelLoadError) as raised:
        convert_gguf(gguf_path, tmp_path / "cache")
    assert str(raised.value).startswith(f"{gguf_path}: ") and message in str(raised.value)
    assert not any((tmp_path / "cache").rglob("config.json")), "nothing is cached for a file refused"


def test_an_array_claiming_more_than_the_file_holds_is_refused_before_it_is_read(tmp_path, f32_gguf):
    # The gguf package reads past the end without advancing: the conversion never ended, its
    # memory growing. The first key-value pair now claims 2^62 one-byte elements.
    data = bytearray(f32_gguf.read_bytes())
    data[16:24] = (int.from_bytes(data[16:24], "little") + 1).to_bytes(8, "little")  # one more key-value pair
    key = b"general.junk"
    data[24:24] = len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little") + (0).to_bytes(4, "little") + (
        2 ** 62).to_bytes(8, "little")
    bomb = tmp_path / "bomb.gguf"
    bomb.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"metadata 'general.junk' \(4611686018427387904 elements\).* past the end"):
        convert_gguf(bomb, tmp_path / "cache")


def test_tensors_whose_bytes_overlap_are_refused_not_read_as_other_weights(tmp_path, f32_gguf):
    reader = GGUFReader(f32_gguf)
    first, second = reader.tensors[0], reader.tensors[1]
    # The second tensor's offset (its info's last part) set to the first's.
    field = second.field
    position = field.offset + sum(part.nbytes for part in field.parts[:-1])
    data = bytearray(f32_gguf.read_bytes())
    data[position:position + 8] = (first.data_offset - reader.data_offset).to_bytes(8, "little")
    del reader
    overlapping = tmp_path / "overlap.gguf"
    overlapping.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="overlap in the file"):
        convert_gguf(overlapping, tmp_path / "cache")


def test_a_file_rewritten_in_place_with_other_weights_in_its_middle_is_converted_again(tmp_path):
    # Same size, same first and last MiB: only its modification time tells it apart.
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf")
    first = convert_gguf(gguf_path, tmp_path / "cache")
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert convert_gguf(gguf_path, tmp_path / "cache") != first


@pytest.mark.parametrize("metadata, message", [
    # Each loaded before, a tokenizer other than the file's (llama.cpp refuses them).
    ({"tokenizer.ggml.token_type": ([1, 1, 1], GGUFValueType.ARRAY)}, "tokenizer.ggml.token_type: 3 values for"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges: a byte-level BPE vocabulary needs its merges"),
    ({"tokenizer.ggml.add_bos_token": ("false", GGUFValueType.STRING)},
     "tokenizer.ggml.add_bos_token: 'false' is not a boolean"),
])
def test_a_vocabulary_whose_arrays_disagree_is_an_error_naming_the_key(tmp_path, metadata, message):
    gguf_path = write_llama_gguf(tmp_path / "vocab.gguf", metadata=metadata)
    with pytest.raises(GGUFTokenizerError, match=message):
        convert_gguf(gguf_path, tmp_path / "cache")
