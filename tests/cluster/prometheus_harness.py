"""A real Prometheus (the `prometheus` binary, e.g. Debian's package) scraping a live cluster
with deploy/prometheus.yml and deploy/alerts.yml, for tests that evaluate the dashboard's
queries and the alert rules the way an operator's Prometheus would.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import requests
import yaml

from replica.model.cache import default_cache_dir

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRAPE_INTERVAL_S = 1
# The dashboard's Grafana variables, as a dashboard showing every model would set them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model": ".*", "$application": ".*"}


# The binaries of Debian's prometheus package the tests run.
PROMETHEUS_TOOLS = ("prometheus", "promtool")


def prometheus_binary() -> Optional[str]:
    """prometheus (`prometheus_tool()`); None without it (`prometheus_unavailable()` says why)."""
    return prometheus_tool("prometheus")


def prometheus_tool(name: str) -> Optional[str]:
    """`name` (prometheus or promtool) from PATH, else from the headroom cache (tools/NAME),
    else fetched into that cache from Debian's package where apt can reach it; None if none
    of them (`prometheus_unavailable()` says why)."""
    found = shutil.which(name)
    cached = default_cache_dir() / "tools" / name
    if found or cached.is_file():
        return found or str(cached)
    return str(cached) if _fetch_from_debian(cached.parent) is None else None


def prometheus_unavailable() -> Optional[str]:
    """Why prometheus_binary() found none (the fetch's error), or None if it found one."""
    return None if prometheus_binary() is not None else _fetch_from_debian(default_cache_dir() / "tools")


@functools.lru_cache(maxsize=None)  # one try per test process: a failed download is not retried per call
def _fetch_from_debian(tools_dir: Path) -> Optional[str]:
    """`apt-get download prometheus` and `dpkg -x` it, its PROMETHEUS_TOOLS into `tools_dir`:
    no root install, no apt state changed. None on success, else why it failed."""
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        return "prometheus not on PATH, and no apt-get/dpkg to fetch Debian's package"
    with tempfile.TemporaryDirectory() as workdir:
        try:
            subprocess.run(["apt-get", "download", "-q", "prometheus"], cwd=workdir, check=True,
                           capture_output=True, timeout=180)
            package = next(Path(workdir).glob("prometheus_*.deb"))
            subprocess.run(["dpkg", "-x", str(package), str(Path(workdir) / "root")], check=True,
                           capture_output=True, timeout=180)
            for name in PROMETHEUS_TOOLS:
                binary = Path(workdir) / "root" / "usr" / "bin" / name
                if not binary.is_file():
                    return f"Debian's {package.name} holds no usr/bin/{name}"
                tools_dir.mkdir(parents=True, exist_ok=True)
                staged = tools_dir / f"{name}.{os.getpid()}.partial"  # one per writer
                shutil.copy2(binary, staged)
                staged.replace(tools_dir / name)  # atomic: a concurrent test never sees half a binary
        except (subprocess.SubprocessError, StopIteration, OSError) as error:
            stderr = getattr(error, "stderr", None) or b""
            return f"fetching Debian's prometheus failed: {error!r} {stderr[-500:].decode(errors='replace')}".strip()
    return None


def scrape_config_for(targets_dir: str) -> dict[str, Any]:
    """deploy/prometheus.yml as it would run beside this cluster: its headroom jobs reading
    `targets_dir` (the cluster's file_sd directory), scraping every second; Ray's own job,
    which is not headroom's to test, left out."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_INTERVAL_S}s", evaluation_interval=f"{SCRAPE_INTERVAL_S}s")
    config["rule_files"] = [str(DEPLOY / "alerts.yml")]
    jobs = []
    for job in config["scrape_configs"]:
        if not job["job_name"].startswith("headroom-"):
            continue
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(Path(targets_dir) / Path(pattern).name) for pattern in sd["files"]]
            sd["refresh_interval"] = "1s"
        jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str, at: Optional[float] = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = requests.get(f"{self.url}/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: int = 1) -> list[dict]:
        """Every series over [start, end], as a dashboard panel over that time range draws it."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s}s"}
        body = requests.get(f"{self.url}/api/v1/query_range", params=params, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def active_targets(self) -> list[dict]:
        return requests.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def wait_for_targets(self, job: str, count: int, timeout_s: float = 30.0) -> list[dict]:
        """The job's targets once `count` of them are up."""
        deadline = time.monotonic() + timeout_s
        while True:
            targets = [target for target in self.active_targets() if target["labels"]["job"] == job]
            if sum(target["health"] == "up" for target in targets) >= count:
                return targets
            if time.monotonic() > deadline:
                raise AssertionError(f"{job}: {count} targets never up: {targets}")
            time.sleep(0.5)


@contextlib.contextmanager
def running_prometheus(config: dict[str, Any], work_dir: Path) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    assert binary is not None
    config_file = work_dir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={config_file}", f"--storage.tsdb.path={work_dir / 'data'}",
         f"--web.listen-address={address}"],
        stdout=subprocess.DEVNULL, stderr=open(work_dir / "prometheus.log", "w"),
    )
    prometheus = Prometheus(f"http://{address}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start: {(work_dir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield prometheus
    finally:
        process.terminate()
        process.wait(timeout=30)


def with_grafana_variables(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query
