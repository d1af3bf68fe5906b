"""Tokenizer loading and round trips, and the incremental detokenizer's stream of text deltas."""

import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.model.checkpoint import check_checkpoint
from replica.model.config import ModelLoadError
from replica.model.builtin import BOS_TOKEN_ID, EOS_TOKEN_ID, build_byte_level_tokenizer, ensure_builtin_model
from replica.text.chat_template import ChatTemplateError, resolve_chat_template
from replica.text.tokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer, Tokenizer, TokenizerLoadError

MULTI_BYTE_TEXTS = ["plain ascii", "héllo wörld", "你好，世界", "emoji 👋🏽 and 👨‍👩‍👧", "mixed: 日本語 ∑ x² 🚀!"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_builtin_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_pretrained(model_dir)


class WindowOnlyTokenizer(Tokenizer):
    """Without tokenizers' DecodeStream: the detokenizer's own window throughout, as a
    SentencePiece tokenizer runs."""

    def decode_stream(self, skip_special_tokens=True):
        return None


@pytest.fixture(scope="module", params=["decode_stream", "window"])
def detokenizing(model_dir, request):
    """The built-in tokenizer, detokenized by each of IncrementalDetokenizer's two paths."""
    return (Tokenizer if request.param == "decode_stream" else WindowOnlyTokenizer).from_pretrained(model_dir)


def stream(tokenizer, token_ids, chunk_size=1):
    """The deltas an IncrementalDetokenizer yields for token_ids fed chunk_size at a time, then flush()."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens(token_ids[i : i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    return deltas + [detokenizer.flush()]


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_encode_decode_round_trips_multi_byte_text(tokenizer, text):
    token_ids = tokenizer.encode(text)
    assert token_ids[0] == BOS_TOKEN_ID
    assert len(token_ids) == 1 + len(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(token_ids) == text


def test_encode_adds_bos_exactly_once(tokenizer):
    assert tokenizer.encode("hi") == [BOS_TOKEN_ID, ord("h"), ord("i")]
    assert tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def test_config_add_bos_token_adds_bos_when_the_tokenizer_json_does_not(model_dir, tmp_path):
    bare_dir = tmp_path / "model"
    shutil.copytree(model_dir, bare_dir)
    tokenizer_json = json.loads((bare_dir / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (bare_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    assert Tokenizer.from_pretrained(bare_dir).encode("hi") == [BOS_TOKEN_ID, ord("h"), ord("i")]


def test_decode_skips_special_tokens_unless_asked(tokenizer):
    token_ids = [BOS_TOKEN_ID, ord("o"), ord("k"), EOS_TOKEN_ID]
    assert tokenizer.decode(token_ids) == "ok"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "<s>ok</s>"


def test_special_token_ids_and_vocab_size_come_from_the_directory(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (256, 257, 320)


def test_missing_tokenizer_raises_an_error_naming_the_file(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json does not exist"):
        Tokenizer.from_pretrained(tmp_path)


def test_without_tokenizer_json_falls_back_to_transformers(tmp_path):
    pytest.importorskip("transformers")
    build_byte_level_tokenizer().model.save(str(tmp_path))  # GPT-2 style vocab.json + merges.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("é👋") == list("é👋".encode("utf-8"))
    assert tokenizer.decode(tokenizer.encode("é👋")) == "é👋"


def test_the_builtin_models_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tokenizer.apply_chat_template(messages) == "<s><|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"


def without_chat_template(model_dir, directory):
    """A copy of the builtin model as a base model ships: no chat template anywhere."""
    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_model_without_a_chat_template_refuses_chat_rather_than_inventing_a_format(model_dir, tmp_path):
    tokenizer = Tokenizer.from_pretrained(without_chat_template(model_dir, tmp_path / "base"))
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template.*--chat-template FILE"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])


def test_a_chat_template_given_to_the_server_is_used_instead_of_the_checkpoints(model_dir, tmp_path):
    text = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (tmp_path / "template.jinja").write_text(text)
    for value in (str(tmp_path / "template.jinja"), text):  # a file, or the template inline (vLLM's two forms)
        for directory in (model_dir, without_chat_template(model_dir, tmp_path / f"base{len(value)}")):
            tokenizer = Tokenizer.from_pretrained(directory, chat_template=resolve_chat_template(value))
            assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}]) == "user: Hi!\nassistant:"


def test_a_broken_checkpoint_template_is_what_the_server_template_replaces(model_dir, tmp_path):
    # vLLM's --chat-template replaces the tokenizer's; here the checkpoint's was compiled anyway
    # (by the start-up check and by the engine core), so a model whose own template does not
    # compile could not be served with a good one given.
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}"  # the for is never closed
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not compile.*--chat-template FILE replaces it"):
        check_checkpoint(broken)
    good = resolve_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    check_checkpoint(broken, chat_template=good)
    assert Tokenizer.from_pretrained(broken, chat_template=good).apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi"
    core = Tokenizer.from_pretrained(broken, check_chat_template=False)  # as the engine core loads it
    assert core.encode("Hi", add_special_tokens=False) == Tokenizer.from_pretrained(model_dir).encode("Hi", add_special_tokens=False)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        core.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_a_chat_template_from_a_pipe_is_read_and_a_directory_is_refused(tmp_path):
    read, write = os.pipe()  # what `--chat-template <(...)` hands over: /dev/fd/N, no regular file
    os.write(write, b"{{ messages[0]['content'] }}")
    os.close(write)
    try:
        assert resolve_chat_template(f"/dev/fd/{read}") == "{{ messages[0]['content'] }}"
    finally:
        os.close(read)
    with pytest.raises(ChatTemplateError, match="is a directory"):
        resolve_chat_template(str(tmp_path))


@pytest.mark.parametrize("content, error", [
    (None, "no such file"),
    (b"\xff\xfe{{", "is not UTF-8 text"),
    (b"  \n", "the chat template is empty"),
    (b"{% for m in messages %}", "the chat template does not compile"),
])
def test_a_bad_chat_template_file_is_refused_naming_the_file(tmp_path, content, error):
    template = tmp_path / "template.jinja"
    if content is not None:
        template.write_bytes(content)
    with pytest.raises(ChatTemplateError, match=f"template.jinja: {error}"):
        resolve_chat_template(str(template))


def test_chat_template_in_the_directory_is_rendered_with_its_special_tokens(model_dir, tmp_path):
    chat_dir = tmp_path / "chat-model"
    shutil.copytree(model_dir, chat_dir)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ sep_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    config["sep_token"] = "</s>"  # every named special token, as transformers passes them (was bos/eos/unk/pad)
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
    prompt = Tokenizer.from_pretrained(chat_dir).apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert prompt == "<s>[user] Hi!</s>\n[assistant] "


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_incremental_deltas_never_split_a_character(detokenizing, text):
    deltas = stream(detokenizing, detokenizing.encode(text, add_special_tokens=False))
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_a_multi_byte_character_is_held_back_until_its_last_byte(detokenizing):
    detokenizer = IncrementalDetokenizer(detokenizing)
    euro_byte_tokens = list("€".encode("utf-8"))
    assert [detokenizer.add_tokens([token_id]) for token_id in euro_byte_tokens] == ["", "", "€"]


def test_flush_releases_an_incomplete_trailing_character(detokenizing):
    token_ids = [ord("a")] + list("€".encode("utf-8"))[:2]  # cut off mid-character, e.g. by max_tokens
    detokenizer = IncrementalDetokenizer(detokenizing)
    assert [detokenizer.add_tokens([token_id]) for token_id in token_ids] == ["a", "", ""]
    assert detokenizer.flush() == detokenizing.decode(token_ids)[1:] == "\ufffd"


def test_special_tokens_are_kept_when_not_skipped(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert detokenizer.add_tokens([ord("o"), ord("k"), EOS_TOKEN_ID]) == "ok</s>"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40).filter(lambda text: "\ufffd" not in text), chunk_size=st.integers(1, 5))
def test_deltas_of_valid_text_concatenate_to_the_full_decode(detokenizing, text, chunk_size):
    token_ids = detokenizing.encode(text, add_special_tokens=False)
    deltas = stream(detokenizing, token_ids, chunk_size)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == detokenizing.decode(token_ids)


@settings(max_examples=200, deadline=None)
@given(token_ids=st.lists(st.integers(0, 400), max_size=40), chunk_size=st.integers(1, 5))
def test_deltas_of_any_token_stream_concatenate_to_the_full_decode(detokenizing, token_ids, chunk_size):
    # What a random-weight model emits: invalid UTF-8, special tokens and (a model whose vocabulary
    # is larger than its tokenizer's, as bench_gpu.py's checkpoint) ids past the vocabulary.
    assert detokenizing.vocab_size == 320
    assert "".join(stream(detokenizing, token_ids, chunk_size)) == detokenizing.decode(token_ids)


@pytest.mark.parametrize("skipped_id", [EOS_TOKEN_ID, 5_000])
def test_ids_decode_drops_never_grow_the_decode_window(detokenizing, skipped_id):
    """A stream held on a skipped special token (logit_bias, ignore_eos) or on ids past the
    tokenizer's vocabulary: each step decoded the whole run of them, quadratic in its length."""
    detokenizer = IncrementalDetokenizer(detokenizing)
    assert detokenizer.add_tokens([ord("a")]) == "a"
    for _ in range(1_000):
        assert detokenizer.add_tokens([skipped_id]) == ""
    assert len(detokenizer.output_token_ids) - detokenizer.prefix_offset <= 1  # the window: "a" alone
    assert detokenizer.add_tokens([skipped_id, ord("b")]) == "b"
    kept = IncrementalDetokenizer(detokenizing, skip_special_tokens=False)  # not dropped when kept
    assert kept.add_tokens([ord("o"), EOS_TOKEN_ID]) == "o</s>"


class CountingTokenizer(Tokenizer):
    """Counts the token ids it decodes: the detokenizer's work."""

    decoded = 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.decoded += len(token_ids)
        return super().decode(token_ids, skip_special_tokens)


def test_a_byte_level_stream_is_detokenized_by_tokenizers_decode_stream(model_dir):
    """The built-in tokenizer is byte-level, so text goes through tokenizers' DecodeStream (Rust):
    no Python-side decode until the flush, and the deltas still concatenate to the full decode."""
    tokenizer = CountingTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer.encode("héllo wörld, 你好 👋🏽!", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([token_id]) for token_id in token_ids]
    assert tokenizer.decoded == 0
    assert "".join(deltas) + detokenizer.flush() == "héllo wörld, 你好 👋🏽!"


def test_a_run_that_is_not_text_is_not_decoded_whole_at_every_step(model_dir):
    """A byte token forced by logit_bias (here 0x80, a lone continuation byte): every decode of
    the run ends in a replacement character, so its text is held, and decoding the whole run
    each step cost the square of its length (SmolLM2's tokenizer: 0.8 s of the front's event
    loop for 4,000 tokens). The text released stays exactly the full decode's."""
    tokenizer = CountingTokenizer.from_pretrained(model_dir)
    run = [0x80] * 2_000 + list(b"ok" + b"." * 2_000)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([token_id]) for token_id in run]
    # Linear (it was ~2 million: a decode of the run per step); ~23 per token since settled
    # bytes go out every MAX_HELD_TOKENS tokens, each look decoding a window of that size.
    assert tokenizer.decoded < 40 * len(run)
    assert "ok" in "".join(deltas)  # text after the run waits at most the run's length, not the request's end
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(run) == "\ufffd" * 2_000 + "ok" + "." * 2_000


@pytest.mark.parametrize("seed", range(3))
def test_garbage_bytes_are_released_as_they_settle_not_when_the_run_ends(model_dir, seed):
    """A model writing random bytes (the built-in random model does): its decode ends in a
    replacement character at most steps, and the text was held until a look at a doubling of
    the run found a clean end: runs of a hundred tokens and more went out at once, after as long
    a silence (0.7 s on a stream in tests/cluster/test_outside_clients.py). Past MAX_HELD_TOKENS
    what has settled (up to a whole character near the end) goes out at once; the text released
    is still exactly the full decode, and the decoding stays linear."""
    import random

    rng = random.Random(seed)  # a byte in five ASCII (the window could end cleanly there), the rest not
    run = [rng.randrange(32, 127) if rng.random() < 0.2 else rng.randrange(128, 256) for _ in range(3_000)]
    tokenizer = CountingTokenizer.from_pretrained(model_dir)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([token_id]) for token_id in run]
    silent = longest = 0
    for delta in deltas:
        silent = 0 if delta else silent + 1
        longest = max(longest, silent)
    assert longest <= MAX_HELD_TOKENS, longest  # 135-271 tokens before
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(run)
    assert tokenizer.decoded < 40 * len(run)


def byte_fallback_tokenizer(directory) -> Tokenizer:
    """A SentencePiece-style tokenizer: 'a' and 'b' as pieces, every other character as its
    UTF-8 bytes' <0xNN> tokens, decoded by ByteFallback."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "a": 1, "b": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    fast = FastTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fast.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fast.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_pretrained(directory)


def test_token_bytes_rebuild_the_text_where_single_tokens_decode_to_replacement_characters(
        tokenizer, smollm2_dir, tmp_path):
    """OpenAI's logprobs `bytes` exist so a client can rebuild the text; a token that is part of
    a UTF-8 character decoded alone is U+FFFD, whose three bytes were sent instead of its own."""
    text = "Héllo wörld 😀 €uro <tag>"
    for each in (tokenizer, Tokenizer.from_pretrained(smollm2_dir)):  # byte-level: tokens of one byte; merges
        token_ids = each.encode(text, add_special_tokens=False)
        assert b"".join(each.token_bytes(token_id) for token_id in token_ids).decode() == text
        assert any(each.decode([token_id]) == "\ufffd" for token_id in token_ids), "the probe: a token is a piece"
    assert tokenizer.token_bytes(EOS_TOKEN_ID) == tokenizer.decode([EOS_TOKEN_ID], skip_special_tokens=False).encode()
    fallback = byte_fallback_tokenizer(tmp_path)
    token_ids = fallback.encode("abé", add_special_tokens=False)
    assert len(token_ids) == 4 and b"".join(fallback.token_bytes(token_id) for token_id in token_ids) == "abé".encode()
