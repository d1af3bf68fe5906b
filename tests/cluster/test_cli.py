"""The `headroom` CLI: engine flags come from EngineConfig and bad values exit 2 naming the
field; `headroom replica` serves gRPC until SIGINT and then exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from cluster.cli import build_parser, main
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_config_field_is_a_replica_flag():
    args = build_parser().parse_args(["replica"])
    assert all(hasattr(args, name) for name in EngineConfig.model_fields)


@pytest.mark.parametrize("flags, field", [
    (["--max-model-len", "0"], "max_model_len"),
    (["--watermark", "1.5"], "watermark"),
    (["--max-model-len", "512", "--num-kv-blocks", "4"], "num_kv_blocks"),
])
def test_bad_engine_value_exits_2_naming_the_field(flags, field, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replica", *flags])
    assert exited.value.code == 2
    assert f"error: {field}:" in capsys.readouterr().err


def test_replica_serves_generate_until_sigint_then_exits_0():
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "replica", "--port", "0", "--max-model-len", "128",
         "--num-kv-blocks", "32", "--replica-id", "cli-replica"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy(),
    )
    try:
        port = None
        for line in process.stdout:  # the port is printed once the server listens
            if match := re.match(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None, "the replica never printed its port"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
            responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))
        assert responses[-1].usage.completion_tokens == 3 and responses[-1].replica_id == "cli-replica"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
