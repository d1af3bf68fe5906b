"""The ingress' Prometheus file-discovery targets (cluster/prometheus_targets.py) across an
in-place update: Serve starts the application's new ingress while the old one drains, and
the old one stops (its __del__) after the new one wrote its files."""

import asyncio
import json

from cluster import prometheus_targets
from cluster.prometheus_targets import PrometheusTargets, replicas_file, router_file


def read(path) -> list:
    return json.loads(path.read_text())


def test_a_replaced_ingress_leaves_its_successors_files_and_a_missing_file_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setattr(prometheus_targets, "REFRESH_S", 0.02)
    replicas = ["10.0.0.5:9100", "10.0.0.6:9100"]
    labels = {"application": "app"}

    async def endpoints() -> list[str]:
        return list(replicas)

    async def update() -> None:
        old = PrometheusTargets(tmp_path, "app", "10.0.0.1:9200", endpoints)
        old.start()
        await asyncio.sleep(0.1)
        new = PrometheusTargets(tmp_path, "app", "10.0.0.1:9201", endpoints)
        new.start()
        await asyncio.sleep(0.1)
        old.stop()  # after its drain
        assert read(router_file(tmp_path, "app")) == [{"targets": ["10.0.0.1:9201"], "labels": labels}]
        # Both listed the same replicas; the file there is whichever wrote last, and if that was
        # the old one's, the new one writes it again.
        await asyncio.sleep(0.1)
        assert read(replicas_file(tmp_path, "app")) == [{"targets": replicas, "labels": labels}]
        # Anything that removes them (an operator clearing the directory): back within a refresh.
        router_file(tmp_path, "app").unlink()
        replicas_file(tmp_path, "app").unlink()
        await asyncio.sleep(0.1)
        assert read(router_file(tmp_path, "app")) == [{"targets": ["10.0.0.1:9201"], "labels": labels}]
        assert read(replicas_file(tmp_path, "app")) == [{"targets": replicas, "labels": labels}]
        new.stop()
        assert sorted(tmp_path.iterdir()) == []  # the last one removes its own

    asyncio.run(update())

