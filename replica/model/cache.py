"""headroom's local model cache ($HEADROOM_CACHE_DIR, default ~/.cache/headroom): where the
built-in model, fetched packages and converted GGUF checkpoints live, each directory written
once into a staging sibling and renamed into place so no reader ever sees half of one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

CACHE_DIR_ENV_VAR = "HEADROOM_CACHE_DIR"
# Part of every converted GGUF's cache entry name: bump it when the files replica/model/gguf.py
# writes change.
GGUF_CONVERTER_VERSION = 1
CONVERTED_GGUF_SUBDIR = "gguf"
# The GGUF cache key reads this much of each end of the file (plus its size): content-addressed,
# yet fast on multi-gigabyte files.
_GGUF_FINGERPRINT_BYTES = 1 << 20


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV_VAR) or Path.home() / ".cache" / "headroom")


def build_once(target_dir: Path, write_files: Callable[[Path], None]) -> Path:
    """target_dir, created by write_files(staging_dir) unless it already exists.

    Concurrent builders (two replicas starting at once) each write their own staging copy;
    the first rename wins and the others keep it, since every copy is identical.
    """
    if target_dir.is_dir():
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp-", dir=target_dir.parent))
    try:
        write_files(staging_dir)
        os.rename(staging_dir, target_dir)
    except OSError:
        if not target_dir.is_dir():
            raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return target_dir


def converted_gguf_dir(gguf_path: Path, cache_root: Path) -> Path:
    """Where the Hugging Face-style conversion of a GGUF file lives in the cache (there or not).
    Here, not beside the converter: a process that finds it needs neither torch nor gguf."""
    stat = gguf_path.stat()
    # Its size, first and last MiB, and when it was last written: a file rewritten in place with
    # other weights in the middle (a re-exported fine-tune) is converted again.
    digest = hashlib.sha256(f"headroom-gguf-v{GGUF_CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    size = stat.st_size
    with open(gguf_path, "rb") as file:
        digest.update(file.read(_GGUF_FINGERPRINT_BYTES))
        file.seek(max(0, size - _GGUF_FINGERPRINT_BYTES))
        digest.update(file.read(_GGUF_FINGERPRINT_BYTES))
    return cache_root / CONVERTED_GGUF_SUBDIR / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


def report_progress(message: str) -> None:
    """One line on stderr about a slow cache build (a fetch, a conversion).

    Printed, not only logged: a first start spends seconds to minutes here and the user
    should see why, whatever logging the calling command configured.
    """
    print(f"headroom: {message}", file=sys.stderr, flush=True)
