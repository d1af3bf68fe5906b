"""The model's generation_config.json as the defaults of what a request leaves unset (vLLM's
--generation-config auto): a request's own values win, even where they equal the built-in
defaults; `generation_config: none` ignores the file; a file of token ids only (the built-in
model's, a GGUF conversion's: the default model's) changes nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from generation_config_files import RECOMMENDED_MAX_TOKENS, RECOMMENDED_PARAMS, recommending_checkpoint
from gguf_files import write_llama_gguf
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.core.request import SamplingDefaults, SamplingParams
from replica.model.checkpoint import sampling_defaults
from replica.model.config import ModelLoadError
from replica.model.registry import resolve_model_path
from replica.server.grpc_service import sampling_params_from_proto
from replica_harness import RunningReplica, collect_stream

PROMPT = [5, 6, 7, 8] * 4


@pytest.fixture(scope="module")
def recommending_dir(tmp_path_factory) -> Path:
    return recommending_checkpoint(tmp_path_factory.mktemp("models") / "recommending")


def test_what_a_request_leaves_unset_takes_the_models_recommendation(recommending_dir):
    defaults = sampling_defaults(recommending_dir, "auto")
    assert defaults == SamplingDefaults(RECOMMENDED_PARAMS, max_tokens=RECOMMENDED_MAX_TOKENS)
    assert defaults.model_values == {"temperature": 0.7, "top_k": 1, "repetition_penalty": 5.0, "max_tokens": 6}


def test_a_value_equal_to_hfs_own_default_is_no_recommendation(tmp_path):
    """As vLLM reads the file (transformers' to_diff_dict()): an explicit top_k of 50 is HF's
    default written out, and applying it would cut every unset request's sampling to 50 tokens."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 1.0, "top_p": 0.9}))
    assert sampling_defaults(tmp_path, "auto").model_values == {"top_p": 0.9}


def test_generation_config_none_ignores_the_file(recommending_dir):
    assert sampling_defaults(recommending_dir, "none") == SamplingDefaults()


def test_a_file_of_token_ids_only_changes_nothing(tmp_path):
    """The built-in model's and a GGUF conversion's (the default model, SmolLM2, is one) hold
    bos, eos and pad ids only: their requests sample as they always did."""
    converted = resolve_model_path(str(write_llama_gguf(tmp_path / "tiny.gguf")), tmp_path / "cache")
    for model_dir in (resolve_model_path("builtin"), converted):
        assert set(json.loads((model_dir / "generation_config.json").read_text())) <= {
            "bos_token_id", "eos_token_id", "pad_token_id"}
        assert sampling_defaults(model_dir, "auto") == SamplingDefaults()


@pytest.mark.parametrize("generation_config, message", [
    ({"temperature": -1}, r"generation_config.json: temperature -1: must be >= 0"),
    ({"top_p": 2}, r"generation_config.json: top_p 2: must be in \(0, 1\]"),
    ({"top_k": "50"}, r'generation_config.json: top_k "50": must be an integer'),
    ({"repetition_penalty": True}, r"generation_config.json: repetition_penalty true: must be a number"),
    ({"max_new_tokens": 0}, r"generation_config.json: max_new_tokens 0: must be >= 1"),
])
def test_a_default_no_request_could_have_is_one_error_naming_the_file_and_key(generation_config, message, tmp_path):
    """Else every request that left the field unset was refused for a value it never sent."""
    model_dir = recommending_checkpoint(tmp_path / "bad", **generation_config)
    with pytest.raises(ModelLoadError, match=message + r".*generation_config: none"):
        sampling_defaults(model_dir, "auto")
    assert sampling_defaults(model_dir, "none") == SamplingDefaults()


def test_a_generation_config_that_is_not_json_is_named_too(tmp_path):
    model_dir = recommending_checkpoint(tmp_path / "garbled")
    (model_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"generation_config.json: not readable JSON"):
        sampling_defaults(model_dir, "auto")


def test_a_grpc_request_keeps_what_it_sets_even_the_built_in_defaults(recommending_dir):
    defaults = sampling_defaults(recommending_dir, "auto")
    unset = sampling_params_from_proto(pb.SamplingParams(), max_model_len=100, num_prompt_tokens=10, defaults=defaults)
    assert unset == SamplingParams(max_tokens=6, temperature=0.7, top_k=1, repetition_penalty=5.0)
    # Set to what SamplingParams' defaults are (top_k 0 and -1 are both "off"): the request's own.
    built_in = pb.SamplingParams(max_tokens=50, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert sampling_params_from_proto(built_in, max_model_len=100, num_prompt_tokens=10,
                                      defaults=defaults) == SamplingParams(max_tokens=50, top_k=0)
    # An unset max_tokens is up to the context still, where that is less than max_new_tokens.
    assert sampling_params_from_proto(pb.SamplingParams(), max_model_len=100, num_prompt_tokens=96,
                                      defaults=defaults).max_tokens == 4


def test_the_engine_reads_the_file_unless_told_none(recommending_dir):
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine

    for generation_config, expected in (("auto", SamplingDefaults(RECOMMENDED_PARAMS, RECOMMENDED_MAX_TOKENS)), ("none", SamplingDefaults())):
        config = make_engine_config(max_model_len=64, num_kv_blocks=8, generation_config=generation_config)
        assert LLMEngine(config, str(recommending_dir), device="cpu").sampling_defaults == expected


def test_a_replica_serves_unset_sampling_with_the_models_defaults_and_set_sampling_as_set(recommending_dir):
    """Through the replica's gRPC Generate into its engine core: the unset request's tokens are
    the greedy ones under the model's repetition penalty (its top_k of 1), 6 of them (its
    max_new_tokens); one that sets the built-in defaults (repetition_penalty 1.0) gets plain greedy."""
    replica = RunningReplica(model=str(recommending_dir), max_model_len=128, block_size=16, num_kv_blocks=32)
    try:
        assert replica.engine.sampling_defaults == sampling_defaults(recommending_dir, "auto")

        def tokens(**sampling) -> list[int]:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(ignore_eos=True, **sampling))

            async def run():
                async with grpc.aio.insecure_channel(replica.address) as channel:
                    return await collect_stream(pb_grpc.GenerationStub(channel), request)

            return [token_id for response in asyncio.run(run()) for token_id in response.token_ids]

        unset = tokens()
        assert unset == tokens(max_tokens=6, temperature=0.0, repetition_penalty=5.0)
        assert tokens(max_tokens=6, temperature=0.0, repetition_penalty=1.0) != unset
    finally:
        replica.close()
