"""Prometheus file-based service discovery written by the cluster itself: each application's
ingress (on the head node) keeps `<dir>/<app>-replicas.json` (the name percent-encoded) listing
the /metrics endpoint of every running replica of its application, and `<dir>/<app>-router.json`
its own router's, so deploy/prometheus.yml follows the replicas Serve really runs (added,
replaced, scaled away).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import urllib.parse
from pathlib import Path
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

# Prometheus re-reads a changed file at once (and every refresh_interval anyway); a replica
# Serve replaced is out of the file within this long.
REFRESH_S = 5.0


def file_stem(app_name: str) -> str:
    """The application's name as one file name in the directory: a model id such as
    `meta-llama/Llama-3.1-8B-Instruct` names an application, and its `/` would put the files in
    a subdirectory deploy/prometheus.yml's globs never read (or, with `..`, outside the
    directory). Percent-encoded, so two names never share a file; the label keeps the name."""
    return urllib.parse.quote(app_name, safe="")


def replicas_file(directory: Path, app_name: str) -> Path:
    return directory / f"{file_stem(app_name)}-replicas.json"


def router_file(directory: Path, app_name: str) -> Path:
    return directory / f"{file_stem(app_name)}-router.json"


class UnsafeTargetsDir(OSError):
    """The targets directory is another user's: they could replace the files we write there."""


def file_identity(status: os.stat_result) -> tuple[int, int, int]:
    """Which file a path holds: the one a writer made, not another with the same content
    (two ingresses of one application list the same replicas)."""
    return status.st_dev, status.st_ino, status.st_mtime_ns


def write_targets(path: Path, targets: list[str], labels: dict[str, str]) -> tuple[int, int, int]:
    """Writes one file_sd file atomically (Prometheus never reads half of one), through a
    temporary file made anew (O_EXCL: never a name planted beforehand, so a symlink there
    cannot redirect the write: the default directory is under the shared /tmp), in a
    directory this user owns; raises UnsafeTargetsDir for one another user owns. Returns the
    file_identity of the file written."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(os, "getuid") and (owner := directory.stat().st_uid) != os.getuid():
        raise UnsafeTargetsDir(f"monitoring.targets_dir {str(directory)!r} belongs to another user (uid "
                               f"{owner}), who could replace the target files: not written")
    groups = [{"targets": sorted(targets), "labels": labels}] if targets else []
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(json.dumps(groups, indent=1) + "\n")
            file.flush()
            identity = file_identity(os.fstat(file.fileno()))
        os.chmod(temporary, 0o644)  # Prometheus may run as another user; mkstemp made it 0600
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return identity


class PrometheusTargets:
    """Keeps one application's two target files current until stopped, then removes those it
    wrote. An in-place `serve deploy` starts the application's new ingress while the old one
    drains: the old one's stop leaves the files the new one wrote in their place, and the new
    one writes again any file that has gone missing."""

    def __init__(self, directory: Path, app_name: str, router_endpoint: str,
                 replica_endpoints: Callable[[], Awaitable[list[str]]]):
        self.directory = Path(directory)
        self.app_name = app_name
        self.router_endpoint = router_endpoint
        self.replica_endpoints = replica_endpoints
        self._task: asyncio.Task | None = None
        self._written: dict[Path, tuple[int, int, int]] = {}  # path -> file_identity of what this one wrote last

    def start(self) -> None:
        labels = {"application": self.app_name}
        try:
            self._write(router_file(self.directory, self.app_name), [self.router_endpoint], labels)
        except UnsafeTargetsDir as error:  # serving goes on; Prometheus finds no targets there
            logger.error("%s", error)
            return
        self._task = asyncio.get_running_loop().create_task(self._refresh(labels), name="prometheus-targets")

    def _write(self, path: Path, targets: list[str], labels: dict[str, str]) -> None:
        self._written[path] = write_targets(path, targets, labels)

    async def _refresh(self, labels: dict[str, str]) -> None:
        router, replicas = router_file(self.directory, self.app_name), replicas_file(self.directory, self.app_name)
        written: list[str] | None = None
        while True:
            try:
                if not router.exists():  # removed by the ingress this one replaced, as it stopped
                    self._write(router, [self.router_endpoint], labels)
                endpoints = await self.replica_endpoints()
                if endpoints != written or not replicas.exists():
                    self._write(replicas, endpoints, labels)
                    written = endpoints
            except Exception as error:  # a controller hiccup: keep the last file, try again
                logger.warning("could not refresh Prometheus targets of %s: %s", self.app_name, error)
            await asyncio.sleep(REFRESH_S)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        # Only a file that is still the one this one wrote: the application's next ingress (an
        # in-place update starts it while this one drains) may have written its own there.
        for path, identity in self._written.items():
            try:
                if file_identity(path.stat()) == identity:
                    path.unlink()
            except FileNotFoundError:
                pass
            except OSError as error:  # the rest of the shutdown goes on
                logger.warning("could not remove Prometheus targets %s: %s", path, error)
