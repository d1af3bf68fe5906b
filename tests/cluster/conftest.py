"""Fixtures the live-cluster modules share: each module starts its own `cluster` fixture (a
ServeAppsConfig, running); `channel` is a gRPC channel to that cluster's port."""

from __future__ import annotations

import grpc
import pytest

from tests.cluster.serve_harness import grpc_target


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(grpc_target(cluster)) as channel:
        yield channel
