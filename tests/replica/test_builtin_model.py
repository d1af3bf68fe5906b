"""Built-in model: created once, byte-for-byte deterministic, and a valid Hugging Face checkpoint."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from replica.model.builtin import (
    BOS_TOKEN_ID,
    BUILTIN_MODEL_DIRNAME,
    EOS_TOKEN_ID,
    MODEL_CONFIG,
    VOCAB_SIZE,
    ensure_builtin_model,
)
from replica.model.cache import CACHE_DIR_ENV_VAR
from replica.text.tokenizer import Tokenizer

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def builtin_model_dir(tmp_path_factory):
    return ensure_builtin_model(tmp_path_factory.mktemp("cache"))


def test_creates_every_file_under_a_versioned_subfolder(builtin_model_dir):
    assert builtin_model_dir.name == BUILTIN_MODEL_DIRNAME
    assert sorted(path.name for path in builtin_model_dir.iterdir()) == MODEL_FILES


def test_creation_is_deterministic_across_directories(builtin_model_dir, tmp_path):
    other_dir = ensure_builtin_model(tmp_path)
    for name in MODEL_FILES:
        assert (other_dir / name).read_bytes() == (builtin_model_dir / name).read_bytes(), name


def test_second_call_reuses_the_existing_directory(tmp_path):
    first = ensure_builtin_model(tmp_path)
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_concurrent_creators_leave_one_complete_model_and_no_staging_dirs(tmp_path, builtin_model_dir):
    results = []
    creators = [threading.Thread(target=lambda: results.append(ensure_builtin_model(tmp_path))) for _ in range(4)]
    for creator in creators:
        creator.start()
    for creator in creators:
        creator.join()
    assert results == [tmp_path / BUILTIN_MODEL_DIRNAME] * 4
    assert [path.name for path in tmp_path.iterdir()] == [BUILTIN_MODEL_DIRNAME]
    weights = (tmp_path / BUILTIN_MODEL_DIRNAME / "model.safetensors").read_bytes()
    assert weights == (builtin_model_dir / "model.safetensors").read_bytes()


def test_default_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV_VAR, str(tmp_path))
    assert ensure_builtin_model() == tmp_path / BUILTIN_MODEL_DIRNAME


def test_weights_use_hugging_face_llama_names_and_init(builtin_model_dir):
    weights = load_file(builtin_model_dir / "model.safetensors")
    num_layers = MODEL_CONFIG["num_hidden_layers"]
    assert len(weights) == 3 + 9 * num_layers
    assert weights["model.embed_tokens.weight"].shape == (VOCAB_SIZE, 256)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 32, 256)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (256, 688)
    assert torch.equal(weights["model.norm.weight"], torch.ones(256))
    assert abs(weights["lm_head.weight"].std().item() - 0.02) < 0.002
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())


def test_loads_with_transformers_and_gives_finite_logits(builtin_model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    prompt_ids = torch.tensor([Tokenizer.from_pretrained(builtin_model_dir).encode("hello, headroom")])
    with torch.no_grad():
        logits = model(prompt_ids).logits
    assert logits.shape == (1, prompt_ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_transformers_tokenizer_agrees_with_ours(builtin_model_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_pretrained(builtin_model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(builtin_model_dir, local_files_only=True)
    text = "héllo wörld, 你好 👋🏽"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text), skip_special_tokens=True) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE)
