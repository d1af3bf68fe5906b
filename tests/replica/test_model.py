"""The Llama-family model and its loader against Hugging Face transformers on tiny random checkpoints.

Each checkpoint is written with save_pretrained; our logits through the paged KV path must
equal HF's forward logits, however the tokens are split into steps.
"""

import json

import pytest
import torch
import transformers
from model_harness import BLOCK_SIZE, NUM_BLOCKS, PagedRunner
from safetensors.torch import load_file, save_file

from replica.attention import AttentionMetadata, allocate_kv_cache
from replica.model import ModelConfig, ModelConfigError, ModelLoadError, OutputRows, load_model
from replica.model.config import DTYPE_BYTES, DTYPE_NAMES, parse_dtype

PROMPT_LEN = 13
LOGITS_TOLERANCE = 1e-4

TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
CHECKPOINT_CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(
        **TINY_SHAPE, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "qwen2_tied": lambda: transformers.Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**TINY_SHAPE, head_dim=16),
}


def _randomize(hf_model) -> None:
    """HF initialises biases to 0 and norms to 1; random values make every weight's mapping matter."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


@pytest.fixture(scope="module", params=list(CHECKPOINT_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(checkpoint dir, HF model) for each architecture."""
    torch.manual_seed(0)
    hf_config = CHECKPOINT_CONFIGS[request.param]()
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _randomize(hf_model)
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_SHAPE)).eval()
    model_dir = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, TINY_SHAPE["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_prefill_through_the_paged_cache_matches_hf_logits_at_every_position(checkpoint):
    model_dir, hf_model = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    prompt = _prompt(PROMPT_LEN, seed=1)
    block_ids = [5, 2, 9, 7]  # out of order on purpose: the cache is paged, not contiguous
    positions = torch.arange(PROMPT_LEN)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, PROMPT_LEN], dtype=torch.int32),
        seq_lens=torch.tensor([PROMPT_LEN], dtype=torch.int32),
        block_tables=torch.tensor([block_ids], dtype=torch.int32),
        slot_mapping=torch.tensor([block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]),
        max_query_len=PROMPT_LEN,
        max_seq_len=PROMPT_LEN,
    )
    kv_caches = allocate_kv_cache(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads,
                                  cfg.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt), positions, kv_caches, meta))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=LOGITS_TOLERANCE, rtol=0)


def test_output_rows_get_the_full_passs_hidden_states_with_the_last_layer_run_for_them_alone(checkpoint):
    """One pass: a 10-token prefill that samples its last token and a 6-token chunk that samples
    nothing. With OutputRows the pass returns the sampling row only, as the full pass computes it;
    every token's K/V is written in every layer all the same; the last layer's MLP sees one row."""
    model_dir, _ = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    tokens = _prompt(16, seed=3)
    block_ids = [[5, 2, 9], [7, 11]]  # 10 and 6 tokens in blocks of 4
    positions = torch.tensor([*range(10), *range(6)])
    slots = [block_ids[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(10)]
    slots += [block_ids[1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(6)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 10, 16], dtype=torch.int32),
        seq_lens=torch.tensor([10, 6], dtype=torch.int32),
        block_tables=torch.tensor([block_ids[0], block_ids[1] + [0]], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), max_query_len=10, max_seq_len=10,
    )
    sampling_row = OutputRows(torch.tensor([9]), AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([10], dtype=torch.int32),
        block_tables=torch.tensor([block_ids[0]], dtype=torch.int32), slot_mapping=torch.tensor([slots[9]]),
        max_query_len=1, max_seq_len=10,
    ))
    mlp_rows = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda module, inputs, output: mlp_rows.append(inputs[0].shape[0]))

    def run(output_rows):
        kv_caches = allocate_kv_cache(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads,
                                      cfg.head_dim, torch.float32, "cpu")
        with torch.inference_mode():
            return model(torch.tensor(tokens), positions, kv_caches, meta, output_rows=output_rows), kv_caches

    full, full_caches = run(None)
    mlp_rows.clear()
    pruned, pruned_caches = run(sampling_row)
    assert pruned.shape == (1, cfg.hidden_size)
    torch.testing.assert_close(pruned[0], full[9], atol=1e-5, rtol=1e-5)
    for (full_keys, full_values), (keys, values) in zip(full_caches, pruned_caches):
        assert torch.equal(keys, full_keys) and torch.equal(values, full_values)
    assert mlp_rows == [16] * (cfg.num_hidden_layers - 1) + [1]


def test_two_prefill_chunks_then_decodes_match_hf_logits(checkpoint):
    model_dir, hf_model = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    tokens = _prompt(PROMPT_LEN + 2, seed=2)  # the prompt, then two "sampled" tokens fed back
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(model, cfg)

    steps = [tokens[:5], tokens[5:PROMPT_LEN], [tokens[PROMPT_LEN]], [tokens[PROMPT_LEN + 1]]]
    num_done = 0
    for step_tokens in steps:
        num_done += len(step_tokens)
        logits = runner.step({"seq": step_tokens})["seq"]
        torch.testing.assert_close(logits, expected[num_done - 1], atol=LOGITS_TOLERANCE, rtol=0)


def test_prefill_chunk_and_decode_of_two_sequences_share_one_forward_pass(checkpoint):
    model_dir, hf_model = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    first, second = _prompt(9, seed=3), _prompt(11, seed=4)
    runner = PagedRunner(model, cfg)
    runner.step({"first": first[:8]})
    logits = runner.step({"second": second[:6], "first": first[8:]})
    torch.testing.assert_close(logits["first"], hf_logits(hf_model, first)[-1], atol=LOGITS_TOLERANCE, rtol=0)
    torch.testing.assert_close(logits["second"], hf_logits(hf_model, second[:6])[-1], atol=LOGITS_TOLERANCE, rtol=0)
    logits = runner.step({"second": second[6:]})
    torch.testing.assert_close(logits["second"], hf_logits(hf_model, second)[-1], atol=LOGITS_TOLERANCE, rtol=0)


def test_tied_checkpoint_shares_the_embedding_with_lm_head(checkpoint):
    model_dir, _ = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_cpu_projections_are_stored_input_major_with_the_checkpoints_values(checkpoint):
    """On the CPU each projection's [out, in] weight is the transpose of a contiguous [in, out]
    tensor (the GEMM runs untransposed, faster at decode's row counts); a tied lm_head stays the
    embedding's rows. Values and the forward's output are those of the checkpoint as stored."""
    model_dir, _ = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    weights = load_file(model_dir / "model.safetensors")
    attention = model.model.layers[0].self_attn
    projections = [attention.qkv_proj, attention.o_proj, model.model.layers[0].mlp.gate_up_proj,
                   model.model.layers[0].mlp.down_proj]
    if not cfg.tie_word_embeddings:
        projections.append(model.lm_head)
    for linear in projections:
        assert linear.weight.t().is_contiguous() and not linear.weight.is_contiguous()
    assert model.model.embed_tokens.weight.is_contiguous()
    assert torch.equal(attention.o_proj.weight, weights["model.layers.0.self_attn.o_proj.weight"])
    hidden = torch.randn(24, cfg.hidden_size)
    torch.testing.assert_close(attention.o_proj(hidden),
                               hidden @ weights["model.layers.0.self_attn.o_proj.weight"].t(), rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    hf_model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, _ = load_model(tmp_path, attention_backend="torch")
    single, _ = load_model(llama_dir, attention_backend="torch")
    for (name, sharded_param), single_param in zip(sharded.named_parameters(), single.parameters()):
        assert torch.equal(sharded_param, single_param), name


def test_merged_projections_stack_hf_tensors_in_shard_order(checkpoint):
    model_dir, _ = checkpoint
    model, cfg = load_model(model_dir, attention_backend="torch")
    weights = load_file(model_dir / "model.safetensors")
    last = cfg.num_hidden_layers - 1
    attention, mlp = model.model.layers[last].self_attn, model.model.layers[last].mlp
    prefix = f"model.layers.{last}"
    kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)  # Qwen2: q/k/v biases merge too
    for kind in kinds:
        hf_qkv = [weights[f"{prefix}.self_attn.{name}.{kind}"] for name in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(getattr(attention.qkv_proj, kind), torch.cat(hf_qkv))
    hf_gate_up = [weights[f"{prefix}.mlp.{name}.weight"] for name in ("gate_proj", "up_proj")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(hf_gate_up))
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name, _ in model.named_parameters())


def test_dtype_override_casts_weights_and_logits_stay_float32(llama_dir):
    model, cfg = load_model(llama_dir, dtype="float16", attention_backend="torch")
    assert cfg.torch_dtype == torch.float32 and cfg.dtype == "float32"  # the config keeps the checkpoint's own dtype
    assert {param.dtype for param in model.parameters()} == {torch.float16}
    # The rotary table, computed in fp32 at construction, is cast like HF casts cos/sin to the model dtype.
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float16
    assert model.model.rotary_emb.cos_sin_cache.shape == (cfg.max_position_embeddings, cfg.head_dim)
    assert model.compute_logits(torch.zeros(1, cfg.hidden_size, dtype=torch.float16)).dtype == torch.float32


def test_layer_hook_runs_before_each_layer_and_can_abort_the_pass(llama_dir):
    model, cfg = load_model(llama_dir, attention_backend="torch")
    runner = PagedRunner(model, cfg)
    seen = []
    runner.step({"seq": [1, 2, 3]}, layer_hook=seen.append)
    assert seen == [0, 1]

    class Abort(Exception):
        pass

    def abort_at_layer_1(layer_idx):
        if layer_idx == 1:
            raise Abort

    with pytest.raises(Abort):
        runner.step({"seq": [4]}, layer_hook=abort_at_layer_1)


def _edit_config(model_dir, **changes):
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw.update(changes)
    config_path.write_text(json.dumps(raw))


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    for source in llama_dir.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    return tmp_path


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config_json_is_named(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(llama_copy)


def test_missing_weights_file_is_named(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weights.*model.safetensors"):
        load_model(llama_copy)


def test_unsupported_architecture_names_it_and_the_supported_ones(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    supported = "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"
    with pytest.raises(ModelLoadError, match=f"GPT2LMHeadModel.*{supported}"):
        load_model(llama_copy)
    _edit_config(llama_copy, architectures="GPT2LMHeadModel")  # one name, not a list: not spelled out
    with pytest.raises(ModelLoadError, match=f"unsupported architecture GPT2LMHeadModel; supported: {supported}"):
        load_model(llama_copy)


def test_shape_mismatch_names_the_tensor_and_both_shapes(llama_copy):
    _edit_config(llama_copy, intermediate_size=100)
    expected_message = r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[96, 64\].*\[100, 64\]"
    with pytest.raises(ModelLoadError, match=expected_message):
        load_model(llama_copy)


def test_shape_mismatch_inside_a_merged_projection_names_the_checkpoint_tensor(llama_copy):
    _edit_config(llama_copy, num_key_value_heads=1)
    expected_message = r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[32, 64\].*\[16, 64\]"
    with pytest.raises(ModelLoadError, match=expected_message):
        load_model(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(llama_copy)


def test_unsupported_rope_type_is_named(llama_copy):
    _edit_config(llama_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope type 'yarn'.*default, linear, llama3"):
        load_model(llama_copy)


def test_pre_v5_rope_spelling_parses_like_rope_parameters():
    shape = dict(architectures=["LlamaForCausalLM"], **TINY_SHAPE, eos_token_id=[7, 9])
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    old = ModelConfig.from_hf_config({**shape, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}})
    new = ModelConfig.from_hf_config({**shape, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **llama3}
    assert old.eos_token_ids == (7, 9) and old.head_dim == 16


def test_the_torch_free_dtype_sizes_are_torchs():
    # DTYPE_BYTES sizes a host KV tier before torch is imported (`headroom serve`'s check).
    assert DTYPE_BYTES == {name: parse_dtype(name).itemsize for name in DTYPE_NAMES}


def test_heads_that_do_not_group_evenly_are_rejected():
    with pytest.raises(ModelConfigError, match="num_attention_heads \\(4\\).*num_key_value_heads \\(3\\)"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY_SHAPE, "num_key_value_heads": 3})


def test_a_config_that_says_one_thing_twice_must_agree_and_a_theta_among_the_rope_parameters_counts():
    """transformers' precedence among these has moved between versions; each silently read one
    way diverged from HF at the first tokens."""
    shape = dict(architectures=["LlamaForCausalLM"], **TINY_SHAPE)
    with pytest.raises(ModelConfigError, match="rope_scaling .* and rope_parameters .* disagree"):
        ModelConfig.from_hf_config({**shape, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ModelConfigError, match="rope_theta 10000.0 and the rope parameters' rope_theta 100.0"):
        ModelConfig.from_hf_config({**shape, "rope_theta": 1e4, "rope_scaling": {"rope_type": "default",
                                                                                 "rope_theta": 100.0}})
    assert ModelConfig.from_hf_config({**shape, "rope_scaling": {"rope_type": "default", "rope_theta": 100.0}}
                                      ).rope_theta == 100.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    with pytest.raises(ModelConfigError, match="original_max_position_embeddings 8 and the rope parameters' 32"):
        ModelConfig.from_hf_config({**shape, "rope_parameters": llama3, "original_max_position_embeddings": 8})


def test_a_quantized_checkpoint_is_refused_naming_its_quantization_config():
    """An FP8 checkpoint loaded its weights without their scales: 1,000x off, no error."""
    with pytest.raises(ModelConfigError, match="quantization_config \\(quant_method 'fbgemm_fp8'\\): quantized"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY_SHAPE,
                                    "quantization_config": {"quant_method": "fbgemm_fp8"}})


def test_mistral_without_a_sliding_window_key_has_transformers_4096_window():
    shape = {"architectures": ["MistralForCausalLM"], **TINY_SHAPE, "max_position_embeddings": 32768}
    assert ModelConfig.from_hf_config(shape).sliding_window == 4096
    assert ModelConfig.from_hf_config({**shape, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf_config({**shape, "sliding_window": 1024}).max_model_len == 1024


def test_a_directory_with_both_a_single_file_and_an_index_loads_the_single_file_as_hf_does(llama_copy):
    from replica.model.checkpoint import weight_files

    (llama_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "other.safetensors"}}))
    (llama_copy / "other.safetensors").write_bytes(b"")
    assert weight_files(llama_copy) == [llama_copy / "model.safetensors"]


def test_generation_configs_end_of_sequence_ids_stop_generation_too(llama_copy):
    """HF's generate() stops on them: an instruct model's end-of-turn token may be listed only there."""
    from replica.model.checkpoint import generation_eos_ids

    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 99999, True, 7]}))
    assert generation_eos_ids(llama_copy, vocab_size=256) == (5, 7)  # ids of the vocabulary only
    (llama_copy / "generation_config.json").write_text("not json")
    assert generation_eos_ids(llama_copy, vocab_size=256) == ()
