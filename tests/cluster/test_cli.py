"""The `headroom` CLI: engine flags come from EngineConfig and bad values exit 2 naming the
field; `headroom replica` and `headroom serve` serve gRPC until SIGINT and then exit 0."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fronts import OWN_CONNECTION, engine_core_pid, front_pids, served_connections
from cluster.cli import build_parser, main
from cluster.config import load_config
from cluster.serve_command import check_engine_fits_model, check_host_tiers_fit, serve_config_from_args
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.config import ConfigError, EngineConfig, make_engine_config
from replica.model.builtin import MODEL_CONFIG as BUILTIN_MODEL_CONFIG

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["serve", "generate", "status", "bench", "replica"])
def test_every_commands_help_prints_and_exits_0(command, capsys):
    # An EngineConfig description with a literal % (block_size's) made argparse's help
    # formatting raise: `headroom replica --help` and `headroom serve --help` printed a traceback.
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert "usage: headroom " + command in capsys.readouterr().out


def test_every_engine_config_field_is_a_replica_flag():
    args = build_parser().parse_args(["replica"])
    assert all(hasattr(args, name) for name in EngineConfig.model_fields)


@pytest.mark.parametrize("flags, field", [
    (["--max-model-len", "0"], "max_model_len"),
    (["--watermark", "1.5"], "watermark"),
    (["--max-model-len", "512", "--num-kv-blocks", "4"], "num_kv_blocks"),
    (["--stream-interval", "0"], "stream_interval"),
    (["--preemption-mode", "swap"], "preemption_mode"),  # swapping needs a host KV tier
    (["--block-size", "12"], "block_size"),  # a power of two from 1 to 256
])
def test_bad_engine_value_exits_2_naming_the_field(flags, field, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replica", *flags])
    assert exited.value.code == 2
    assert f"error: {field}:" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    # Each was a traceback from the engine core or the server that used it, exit status 1.
    (["--torch-threads", "-1"], "argument --torch-threads: invalid value '-1': an integer from 1 to 1024"),
    (["--port", "70000"], "argument --port: invalid value '70000': a port, 0-65535"),
    (["--metrics-port", "70000"], "argument --metrics-port: invalid value '70000': a port, 0-65535"),
    (["--attention-backend", "flash"], "argument --attention-backend: invalid choice: 'flash'"),
    (["--device", "tpu"], "argument --device: invalid value 'tpu': cpu, cuda or cuda:N"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--shutdown-grace-s", "nan"], "argument --shutdown-grace-s: invalid value 'nan'"),
    (["--chat-template", "/nonexistent/chat.jinja"], "argument --chat-template: /nonexistent/chat.jinja: no such file"),
    (["--chat-template", "{% for m in messages %}"], "argument --chat-template: the chat template does not compile"),
])
def test_a_replica_flag_the_engine_or_server_would_refuse_exits_2_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replica", "--model", "builtin", *flags])
    assert exited.value.code == 2
    assert f"headroom replica: error: {message}" in capsys.readouterr().err


def test_serve_names_its_chat_template_flag(capsys):
    # Was "ConfigError: chat_template: ..." (with --config, a field the user never wrote).
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--chat-template", "/nonexistent/chat.jinja"])
    assert exited.value.code == 2
    assert "headroom serve: error: argument --chat-template: /nonexistent/chat.jinja: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["replica", "serve"])
def test_a_truncated_checkpoint_exits_2_naming_the_file_before_any_process_starts(command, tmp_path, capsys):
    # Was the engine core's SafetensorError traceback (replica: exit 1), or under serve, each replica's.
    from replica.model.registry import resolve_model_path

    model_dir = tmp_path / "truncated"
    shutil.copytree(resolve_model_path("builtin"), model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(SystemExit) as exited:
        main([command, "--model", str(model_dir)])
    assert exited.value.code == 2
    assert f"error: {weights}: truncated: 100000 bytes, its tensors end at byte" in capsys.readouterr().err


REFUSED_ONCE_THE_MODEL_IS_KNOWN = {  # the field named: the flags that set it
    "num_host_kv_blocks": ["--num-host-kv-blocks", "100000000000"],  # past the host's memory
    "max_model_len": ["--max-model-len", "4096", "--num-kv-blocks", "300"],  # past the model's 2048
}


@pytest.fixture(scope="module")
def refused_once_the_model_is_known() -> dict[str, subprocess.CompletedProcess]:
    """Each case's `headroom replica`, all started at once (each waits on its own engine core's
    start; two cores, half the wait): the field -> how its command ended."""
    processes = {field: subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "replica", "--model", "builtin", "--port", "0", "--num-kv-blocks", "32",
         *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for field, flags in REFUSED_ONCE_THE_MODEL_IS_KNOWN.items()}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(processes)) as pool:
            ended = {field: pool.submit(process.communicate, timeout=300) for field, process in processes.items()}
            outputs = {field: future.result() for field, future in ended.items()}  # each process has exited
        return {field: subprocess.CompletedProcess(process.args, process.returncode, *outputs[field])
                for field, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("field", list(REFUSED_ONCE_THE_MODEL_IS_KNOWN))
def test_a_setting_refused_once_the_model_is_known_exits_2_in_one_line_naming_the_field(field, refused_once_the_model_is_known):
    # Checked in the engine core's process against the model (and the host): the core sends the
    # error to the front without a traceback, and the command says it once.
    result = refused_once_the_model_is_known[field]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if f"{field}:" in line] == [
        next(line for line in result.stderr.splitlines() if line.startswith(f"headroom replica: error: {field}:"))]


def start_replica(*flags: str, stderr=subprocess.DEVNULL, env=None) -> tuple[subprocess.Popen, int]:
    """`headroom replica` on the built-in model and a free port, once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "replica", "--model", "builtin", "--port", "0", "--max-model-len", "128",
         "--num-kv-blocks", "32", *flags],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env or os.environ.copy(),
    )
    process.metrics_port = None
    for line in process.stdout:  # the port is printed once the server listens
        if match := re.match(r"metrics on http://\S+:(\d+)/metrics", line):
            process.metrics_port = int(match.group(1))
        if match := re.match(r"listening on \S+:(\d+)", line):
            return process, int(match.group(1))
    process.kill()
    raise AssertionError("the replica never printed its port")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_replica_serves_generate_until_sigint_then_exits_0(tmp_path):
    # On every interface and without a key: served, with one warning line saying so.
    stderr_file = (tmp_path / "stderr").open("w")
    env = {key: value for key, value in os.environ.items() if not key.startswith("HEADROOM_API_KEY")}
    process, port = start_replica("--replica-id", "cli-replica", "--host", "0.0.0.0", stderr=stderr_file, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
            responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))
        assert responses[-1].usage.completion_tokens == 3 and responses[-1].replica_id == "cli-replica"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        stop(process)
    warnings = [line for line in (tmp_path / "stderr").read_text().splitlines() if "without an API key" in line]
    assert len(warnings) == 1 and "serving on 0.0.0.0" in warnings[0], warnings


def test_replica_with_an_api_key_refuses_generate_without_it_and_leaves_health_open(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# replica keys\nreplica-key-1\n")
    process, port = start_replica("--api-key-file", str(key_file))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
            for metadata in ((), (("authorization", "Bearer replica-key-2"),), (("x-api-key", "replica-key-1"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Generate(request, timeout=30, metadata=metadata))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in refused.value.details() and "replica-key" not in refused.value.details()
            responses = list(stub.Generate(request, timeout=30, metadata=(("authorization", "Bearer replica-key-1"),)))
            assert responses[-1].usage.completion_tokens == 3
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop(process)


def test_a_replica_with_two_fronts_serves_connections_on_both_behind_its_key_counts_them_all_and_drains_them(
        tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("front-key\n")  # every front must take it
    stderr_file = (tmp_path / "stderr").open("w")
    process, port = start_replica("--api-server-count", "2", "--api-key-file", str(key_file), "--metrics-port", "0",
                                  stderr=stderr_file)
    channels = []
    try:
        fronts = front_pids(process.pid)
        core = engine_core_pid(process.pid)
        assert len(fronts) == 2
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
        key = (("authorization", "Bearer front-key"),)
        # A new connection each (no shared subchannel), until the kernel has given each front one.
        first_on = {}  # front index -> the first channel it accepted
        while len(first_on) < 2:
            assert len(channels) < 40, [served_connections(pid, port) for pid in fronts]
            before = [served_connections(pid, port) for pid in fronts]
            channels.append(grpc.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION))
            responses = list(pb_grpc.GenerationStub(channels[-1]).Generate(request, timeout=30, metadata=key))
            assert responses[-1].usage.completion_tokens == 3
            after = [served_connections(pid, port) for pid in fronts]
            first_on.setdefault(next(index for index in range(2) if after[index] > before[index]), channels[-1])
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.GenerationStub(channels[-1]).Generate(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Front 0's /metrics counts every front's streams (and the core's load once).
        text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=30).read().decode()
        def sample(pattern: str) -> float:
            (value,) = re.findall(rf"^{pattern}\{{.*?\}} (\S+)$", text, re.MULTILINE)
            return float(value)

        assert sample(r'headroom_request_success_total(?=\{finish_reason="length")') == len(channels)
        assert sample("headroom_num_requests_running") == 0  # one series: front 0's, not one per front
        # A service manager's stop signals every process (systemd's default): a stream on each
        # front runs to its end within the grace period, the core outlasting both drains.
        streams = [pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            text="hi", sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True)), timeout=60, metadata=key)
            for channel in first_on.values()]
        firsts = [next(stream) for stream in streams]
        for pid in fronts + [core]:
            os.kill(pid, signal.SIGTERM)
        for stream, first in zip(streams, firsts):
            assert ([first] + list(stream))[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert process.wait(timeout=60) == 0
        for pid in fronts[1:] + [core]:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        for channel in channels:
            channel.close()
        stop(process)
    # Each front built its grammar compiler at start, from the engine it attached to.
    assert "no grammar compiler" not in (tmp_path / "stderr").read_text()


def test_a_front_that_dies_mid_stream_frees_its_requests_and_the_other_front_serves_on(tmp_path):
    stderr_file = (tmp_path / "stderr").open("w")
    process, port = start_replica("--api-server-count", "2", stderr=stderr_file)
    channels = []
    try:
        fronts = front_pids(process.pid)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 40))),
                                     sampling=pb.SamplingParams(max_tokens=80, ignore_eos=True))
        # A stream on each front: connections until each front holds one with a stream open.
        streams = {}
        while len(streams) < 2:
            assert len(channels) < 40
            channels.append(grpc.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION))
            before = [served_connections(pid, port) for pid in fronts]
            stream = pb_grpc.GenerationStub(channels[-1]).Generate(request, timeout=60)
            first = next(stream)  # one message, of every token the front had for it by then
            after = [served_connections(pid, port) for pid in fronts]
            front = next(index for index in range(2) if after[index] > before[index])
            if front in streams:
                stream.cancel()
            else:
                streams[front] = (stream, first)
        load_stub = pb_grpc.LoadReporterStub(channels[0])
        os.kill(fronts[1], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as lost:
            list(streams[1][0])
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        stream, first = streams[0]
        rest = [first] + list(stream)  # front 0's stream goes on to its end
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(response.token_ids) for response in rest) == 80
        deadline = time.monotonic() + 30
        while True:  # the dead front's request left the core: every block is free again
            load = load_stub.GetLoad(pb.LoadRequest(), timeout=30)
            if load.num_running == 0 and load.kv_blocks_free == load.kv_blocks_total:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.2)
        # Front 0 says so, loudly, within its watch interval.
        said = f"front 1 (pid {fronts[1]}) exited with code -9; serving on with 1 of 2 fronts"
        while said not in (tmp_path / "stderr").read_text():
            assert time.monotonic() < deadline + 5, (tmp_path / "stderr").read_text()[-2000:]
            time.sleep(0.2)
    finally:
        for channel in channels:
            channel.close()
        stop(process)


def test_an_unusable_key_file_exits_2_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["replica", "--api-key-file", str(tmp_path / "absent")])
    assert exited.value.code == 2
    assert f"error: --api-key-file: cannot read {tmp_path / 'absent'}: No such file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "status", "bench"])
@pytest.mark.parametrize("key", ["clé", "tab\there"])
def test_a_client_key_it_could_not_send_exits_2_naming_the_flag(command, key, capsys):
    # gRPC would refuse the metadata with "INTERNAL: Invalid metadata", naming nothing.
    with pytest.raises(SystemExit) as exited:
        main([command, *(["x"] if command == "generate" else []), "--api-key", key])
    assert exited.value.code == 2
    assert "error: argument --api-key: an API key must be printable ASCII" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # Past what the request's fields carry: ValueError tracebacks from protobuf.
    (["generate", "x", "--max-tokens", "-1"], "argument --max-tokens: invalid value '-1'"),
    (["generate", "x", "--max-tokens", "4294967296"], "argument --max-tokens: invalid value '4294967296'"),
    (["generate", "x", "--seed", "18446744073709551616"], "argument --seed: invalid value"),
    (["generate", "x", "--temperature", "nan"], "argument --temperature: invalid value 'nan'"),
    (["generate", "x", "--top-p", "0"], "argument --top-p: invalid value '0': a number in (0, 1]"),
    (["generate", "x", "--top-p", "1e-46"], "argument --top-p: invalid value '1e-46'"),  # 0 as a 32-bit float
    (["generate", "x", "--temperature", "1e39"], "argument --temperature: invalid value '1e39'"),  # past float32
    (["generate", "x", "--stop", ""], "argument --stop: invalid value '': non-empty UTF-8 text"),
    # An argument the locale could not decode (surrogate escapes): a UnicodeEncodeError traceback.
    (["generate", "caf\udce9"], "argument prompt: invalid value"),
    (["generate", "x", "--choice", "a", "--choice", "\udcff"], "argument --choice: invalid value"),
    (["generate", "x", "--top-k", "-2"], "argument --top-k: invalid value '-2'"),
    (["generate", "x", "--min-p", "1.5"], "argument --min-p: invalid value '1.5'"),
    (["generate", "x", "--grammar", "g", "--regex", "a"], "argument --regex: not allowed with argument --grammar"),
    (["bench", "--max-tokens", "4294967296"], "argument --max-tokens: invalid value '4294967296'"),
    # Metadata gRPC cannot send ("INTERNAL: Invalid metadata", naming nothing).
    (["generate", "x", "--application", "mod\u00e8le"], "argument --application: invalid value"),
    # A bind that could only fail once the replica started, with a traceback.
    (["replica", "--host", "bad host"], "argument --host: invalid value 'bad host': an IP address or a host name"),
    (["replica", "--metrics-port", "50051"], "--metrics-port: 50051 is --port's too"),
    (["replica", "--torch-threads", "100000"], "argument --torch-threads: invalid value '100000'"),
    # ray.init's own refusal of the address: a ValueError traceback.
    (["status", "--address", "nohost"], "--address: Invalid address format: nohost"),
    (["bench", "--address", "nohost"], "--address: Invalid address format: nohost"),  # was ignored
])
def test_a_client_or_replica_flag_refused_before_anything_starts_exits_2_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*argv, *(["--model", "builtin"] if argv[0] == "replica" else [])])
    assert exited.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_a_constraint_file_that_is_no_utf_8_or_missing_exits_2_naming_the_flag(flag, tmp_path, capsys):
    constraint = tmp_path / "constraint"
    constraint.write_bytes(b"\xff{}")
    for path, message in ((constraint, "is not UTF-8 text (byte 0)"), (tmp_path / "absent", "cannot read")):
        with pytest.raises(SystemExit) as exited:
            main(["generate", "x", "--target", "127.0.0.1:1", flag, str(path)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag}: " in err and message in err and str(path) in err


def test_a_replica_port_already_taken_exits_2_naming_it(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            main(["replica", "--model", "builtin", "--port", str(port)])
    assert exited.value.code == 2
    assert f"error: --port: cannot serve gRPC on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_config_files_relative_paths_are_read_from_the_commands_directory(tmp_path, monkeypatch):
    # The replicas and ingresses (Ray workers) run elsewhere, as for the flags' paths.
    (tmp_path / "m").mkdir()
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("model: m\nmodel_id: m\nmonitoring: {targets_dir: prom}\n")
    monkeypatch.chdir(tmp_path)
    args = serve_config_from_args(build_parser().parse_args(["serve", "--config", "serve.yaml"])).applications[0].args
    assert (args.model, args.monitoring.targets_dir) == (str(tmp_path / "m"), str(tmp_path / "prom"))


# ---- headroom serve ----------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "0"], "error: engine.max_model_len:"),
    (["--stream-interval", "0"], "error: engine.stream_interval: Input should be greater than or equal to 1\n"),
    (["--model", "/nonexistent/model"], "error: model '/nonexistent/model': not a known model name"),
    (["--autoscaling", "headroom", "--min-replicas", "4", "--max-replicas", "2"],
     "error: replicas.autoscaling.max_replicas: 2 is below min_replicas 4\n"),
    (["--replicas", "3", "--autoscaling", "requests"],
     "error: replicas.num_replicas: set either num_replicas or autoscaling, not both\n"),
    (["--block-size", "48"], "error: engine.block_size: must be a power of two from 1 to 256, got 48\n"),
    # refused before Ray starts (every replica failed its start in turn, under Serve's retries)
    (["--model", "builtin", "--tensor-parallel-size", "3"], "error: engine.tensor_parallel_size: 3 does not divide"),
    (["--model", "builtin", "--num-host-kv-blocks", "100000000000"],
     "error: engine.num_host_kv_blocks: 100000000000 blocks of 65536 bytes exceed "),
])
def test_serve_with_a_bad_value_exits_2_naming_the_field(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_checks_the_host_kv_tier_against_the_memory_as_the_replica_will(tmp_path, monkeypatch):
    """The replicas refused a host tier past the host's memory only once Ray ran (each in turn,
    one line, exit 1): checked before, with the replica's own arithmetic (one block is every
    tensor-parallel rank's shard of it; a KV head fewer than the ranks is on each of them)."""
    monkeypatch.setattr("replica.config.replica_memory_bytes", lambda: (10 * 2**20, "the host's memory"))
    (tmp_path / "config.json").write_text(json.dumps({**BUILTIN_MODEL_CONFIG, "num_key_value_heads": 1}))
    block_bytes = 2 * 4 * 16 * 1 * 32 * 4  # K and V x 4 layers x 16 tokens x 1 KV head x 32 dims x float32
    fits = 10 * 2**20 // block_bytes
    check_engine_fits_model(make_engine_config(num_host_kv_blocks=fits), tmp_path)
    with pytest.raises(ConfigError, match=rf"^num_host_kv_blocks: {fits + 1} blocks of {block_bytes} bytes exceed "
                                          r"the host's memory \(10485760 bytes\)$"):
        check_engine_fits_model(make_engine_config(num_host_kv_blocks=fits + 1), tmp_path)
    check_engine_fits_model(make_engine_config(num_host_kv_blocks=2 * fits), tmp_path, dtype="float16")
    with pytest.raises(ConfigError, match="^num_host_kv_blocks: "):  # 2 ranks, each holding the one KV head
        check_engine_fits_model(make_engine_config(num_host_kv_blocks=fits, tensor_parallel_size=2), tmp_path)
    with pytest.raises(ConfigError, match="^host_kv_bytes: 100 bytes hold no KV block of this model"):
        check_engine_fits_model(make_engine_config(host_kv_bytes=100), tmp_path)


def test_serve_checks_the_host_kv_tiers_of_every_starting_replica_together(tmp_path, monkeypatch):
    """Each replica's tier fitting alone, two on this machine did not: counted together, over the
    replicas each application starts with, and refused naming the last one's count."""
    memory = (10 * 2**20, "the host's memory")
    monkeypatch.setattr("replica.config.replica_memory_bytes", lambda: memory)
    monkeypatch.setattr("cluster.serve_command.replica_memory_bytes", lambda: memory)
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_MODEL_CONFIG))
    half = 5 * 2**20

    def config(*replicas: dict):
        return load_config({"applications": [{"name": f"app{index}", "route_prefix": f"/app{index}",
                                              "args": {"replicas": counts}} for index, counts in enumerate(replicas)]})

    check_host_tiers_fit(config({"num_replicas": 2}), [half])
    with pytest.raises(ConfigError, match=r"^replicas.num_replicas: the replicas' host KV tiers need 10485762 bytes "
                                          r"together, more than the host's memory \(10485760 bytes\)"):
        check_host_tiers_fit(config({"num_replicas": 2}), [half + 1])
    with pytest.raises(ConfigError, match=r"^applications\[1\]\.args\.replicas\.autoscaling\.min_replicas: "):
        check_host_tiers_fit(config({"num_replicas": 1}, {"autoscaling": {"min_replicas": 1}}, {"num_replicas": 3}),
                             [half, half + 1, 0])
    check_host_tiers_fit(config({"num_replicas": 4}, {"num_replicas": 1}), [0, 2 * half])
    # The bytes a replica's tier takes, as the check above adds them: host_kv_bytes rounds down to whole blocks.
    block_bytes = 2 * 4 * 16 * 4 * 32 * 4  # K and V x 4 layers x 16 tokens x 4 KV heads x 32 dims x float32
    assert check_engine_fits_model(make_engine_config(host_kv_bytes=3 * block_bytes + 1), tmp_path) == 3 * block_bytes
    assert check_engine_fits_model(make_engine_config(), tmp_path) == 0


def test_serve_offline_without_the_default_model_exits_2_naming_the_alternatives(tmp_path):
    offline_index = tmp_path / "offline"  # pip finds nothing here, and reaches no index
    offline_index.mkdir()
    env = {**os.environ, "HEADROOM_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(offline_index)}
    finished = subprocess.run([sys.executable, "-m", "cluster.cli", "serve"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=120, env=env)
    assert finished.returncode == 2
    assert "error: model 'smollm2-135m'" in finished.stderr and "`--model builtin`" in finished.stderr
    assert "ray" not in finished.stdout.lower()  # refused before any cluster started


def test_serve_with_a_bad_config_file_exits_2_naming_the_fields_path(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text((REPO_ROOT / "deploy" / "serve_config.yaml").read_text().replace("staleness_s: 1.0", "staleness_s: -1"))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(config)])
    assert exited.value.code == 2
    assert "error: applications[0].args.router.staleness_s:" in capsys.readouterr().err


def test_serve_refuses_a_boolean_for_a_number_in_its_config_file_but_a_flags_text_still_parses(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text((REPO_ROOT / "deploy" / "serve_config.yaml").read_text().replace(
        "block_size: 16", "block_size: true", 1))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(config)])
    assert exited.value.code == 2
    assert ("error: applications[0].args.engine.block_size: Input should be a number, not the boolean true\n"
            in capsys.readouterr().err)
    # A flag arrives as text: argparse makes it the number before the config sees it.
    args = build_parser().parse_args(["serve", "--config", str(REPO_ROOT / "deploy" / "serve_config.yaml"),
                                      "--block-size", "32"])
    assert serve_config_from_args(args).applications[0].args.engine.block_size == 32


def test_serve_refuses_a_runtime_env_it_would_not_apply(tmp_path, capsys):
    config = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.yaml").read_text())
    config["applications"][0]["runtime_env"] = {"env_vars": {"X": "1"}}
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(config_file)])
    assert exited.value.code == 2
    assert "error: applications[0].runtime_env: not supported by headroom serve" in capsys.readouterr().err


def test_serve_flags_override_every_application_of_the_config_file(tmp_path):
    document = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.yaml").read_text())
    second = {**document["applications"][0], "name": "second", "route_prefix": "/second"}
    document["applications"].append(second)
    config_file = tmp_path / "two_models.yaml"
    config_file.write_text(yaml.safe_dump(document))
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--replicas", "3",
                                      "--max-num-seqs", "8", "--grpc-port", "9500"])
    config = serve_config_from_args(args)
    assert [app.name for app in config.applications] == ["smollm2-135m", "second"]
    for app in config.applications:
        assert app.args.replicas.num_replicas == 3 and app.args.engine.max_num_seqs == 8
        assert app.args.engine.max_num_batched_tokens == 2048  # from the file, untouched
        assert app.args.ports.grpc == config.grpc_options.port == 9500


def test_serve_autoscaling_flags_set_the_policy_and_bounds_and_keep_the_files_knobs(tmp_path):
    """--autoscaling/--min-replicas/--max-replicas write the config's replicas.autoscaling
    (the schema the Serve config and the Helm values use); the file's other knobs stay."""
    document = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.yaml").read_text())
    replicas = document["applications"][0]["args"]["replicas"]
    del replicas["num_replicas"]
    replicas["autoscaling"] = {"policy": "headroom", "max_replicas": 3, "target_utilization": 0.7,
                               "replica_startup_s": 90}
    config_file = tmp_path / "autoscaled.yaml"
    config_file.write_text(yaml.safe_dump(document))
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--autoscaling", "requests",
                                      "--max-replicas", "6"])
    autoscaling = serve_config_from_args(args).applications[0].args.replicas.autoscaling
    assert (autoscaling.policy, autoscaling.min_replicas, autoscaling.max_replicas) == ("requests", 1, 6)
    assert (autoscaling.target_utilization, autoscaling.replica_startup_s) == (0.7, 90)
    # --replicas on the command line replaces the file's autoscaling with a fixed count.
    fixed = serve_config_from_args(build_parser().parse_args(["serve", "--config", str(config_file), "--replicas", "2"]))
    assert fixed.applications[0].args.replicas.autoscaling is None
    assert fixed.applications[0].args.replicas.num_replicas == 2


def test_serve_tls_flags_become_serves_ssl_options_as_absolute_paths(tmp_path, monkeypatch):
    from tests.cluster.tls_harness import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    monkeypatch.chdir(tmp_path)  # Serve's proxies run elsewhere: relative paths are made absolute
    args = build_parser().parse_args(["serve", "--model", "builtin", "--tls-cert", cert.name, "--tls-key", key.name])
    http_options = serve_config_from_args(args).http_options
    assert Path(http_options.ssl_certfile) == cert.resolve() and Path(http_options.ssl_keyfile) == key.resolve()
    assert Path(http_options.ssl_certfile).is_absolute() and http_options.ssl_ca_certs is None


class RayWouldStart(Exception):
    pass


def test_serve_beyond_loopback_without_a_key_warns_in_one_line_before_ray_starts(monkeypatch, caplog):
    from cluster import serve_command

    def stop_before_ray(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(serve_command, "init_local_ray", stop_before_ray)
    for name in ("HEADROOM_API_KEY", "HEADROOM_API_KEY_FILE"):  # restored after the test, --api-key exports it
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    for flags, warnings_expected in ((["--host", "0.0.0.0"], 1), (["--host", "0.0.0.0", "--api-key", "k"], 0),
                                     (["--host", "127.0.0.1"], 0), ([], 0)):
        caplog.clear()
        with pytest.raises(RayWouldStart):
            main(["serve", "--model", "builtin", *proxy_port_flags(), *flags])
        warnings = [record.getMessage() for record in caplog.records if "without an API key" in record.getMessage()]
        assert len(warnings) == warnings_expected, (flags, warnings)
        assert all(warning.startswith("warning: serving on 0.0.0.0") and "\n" not in warning for warning in warnings)


def test_serve_starts_a_ray_of_its_own_whatever_ray_address_names(monkeypatch):
    """Plain ray.init() joined the cluster RAY_ADDRESS names (or a `ray start` left on the
    machine), whose workers never got the environment `headroom serve` sets: its --api-key was
    not enforced there, and nothing said so. address="local" starts a cluster of its own
    whatever RAY_ADDRESS says (Ray's rule; checked by hand against a `ray start --head`)."""
    from cluster import serve_command

    seen = {}

    def record(**options):
        seen.update(options)
        raise RayWouldStart

    monkeypatch.setattr(serve_command.ray, "init", record)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    config = serve_config_from_args(build_parser().parse_args(["serve", "--model", "builtin"]))
    with pytest.raises(RayWouldStart):
        serve_command.init_local_ray(config, 1)
    assert seen["address"] == "local" and seen["num_cpus"] == 1


def test_ssl_ca_certs_is_refused_naming_it_since_serve_would_not_require_client_certificates(tmp_path, capsys):
    from tests.cluster.tls_harness import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "http_options": {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "ssl_ca_certs": str(cert)},
        "applications": [{"name": "builtin", "route_prefix": "/", "import_path": "cluster.app:build_app",
                          "args": {"model": "builtin"}}]}))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(config)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "ssl_ca_certs: Ray Serve 2.60's HTTP proxy never requests a client certificate with it" in err


def test_serve_num_cpus_below_1_is_a_usage_error(capsys):
    # Was ray.init's ValueError traceback ("Resource quantities must be nonnegative") after Ray began starting.
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", "--num-cpus", "-1"])
    assert exited.value.code == 2
    assert "error: argument --num-cpus: invalid value '-1': an integer >= 1\n" in capsys.readouterr().err


def test_serve_model_dot_is_served_under_its_directorys_name(tmp_path, monkeypatch):
    # `--model .` was pydantic's traceback: Path(".").name is empty, and so was the application name.
    model_dir = tmp_path / "MyModel"
    model_dir.mkdir()
    monkeypatch.chdir(model_dir)
    app = serve_config_from_args(build_parser().parse_args(["serve", "--model", "."])).applications[0]
    assert app.name == "MyModel" and app.args.model == str(model_dir)


def test_replicas_that_do_not_fit_the_ray_cluster_are_a_config_error_naming_the_field():
    from cluster.serve_command import check_resources_fit
    from replica.config import ConfigError

    check_resources_fit(load_config({"replicas": {"num_replicas": 2}}), {"CPU": 2.0})
    for document, resources, message in [
        ({"replicas": {"num_replicas": 3}}, {"CPU": 2.0}, "replicas.num_replicas: the replicas need 3 CPUs to start, "
                                                          "the Ray cluster has 2 (--num-cpus"),
        ({"replicas": {"autoscaling": {"min_replicas": 3}}}, {"CPU": 2.0}, "replicas.autoscaling.min_replicas: "),
        ({"replicas": {"num_gpus": 1}}, {"CPU": 8.0}, "replicas.num_gpus: a replica reserves 1 GPUs "),
        ({"replicas": {"num_replicas": 1}, "engine": {"tensor_parallel_size": 2}}, {"CPU": 8.0, "GPU": 1.0},
         "replicas.num_gpus: a replica reserves 2 GPUs (engine.tensor_parallel_size 2); the Ray cluster has 1"),
        # Raised by serve_deployment_options once Serve started the application: a traceback.
        ({"replicas": {"num_replicas": 1, "num_gpus": 1}, "engine": {"tensor_parallel_size": 2}}, {"CPU": 8.0, "GPU": 4.0},
         "replicas.num_gpus: 1 GPUs cannot hold engine.tensor_parallel_size 2 ranks"),
        ({"applications": [{"name": "a", "args": {"replicas": {"num_replicas": 2}}},
                           {"name": "b", "route_prefix": "/b", "args": {"replicas": {"num_replicas": 1}}}]},
         {"CPU": 2.0}, "applications[1].args.replicas.num_replicas: the replicas need 3 CPUs"),
    ]:
        with pytest.raises(ConfigError) as raised:
            check_resources_fit(load_config(document), resources)
        assert str(raised.value).startswith(message), str(raised.value)


def fake_ray(monkeypatch, resources: dict, start) -> list[str]:
    """serve_command with Ray and Serve replaced: the cluster has `resources`, starting the
    applications calls `start(config)`; returns the shutdowns made, in order."""
    from cluster import serve_command

    calls = []
    monkeypatch.setattr(serve_command, "init_local_ray", lambda config, num_cpus: calls.append("ray.init"))
    monkeypatch.setattr(serve_command.ray, "cluster_resources", lambda: resources)
    monkeypatch.setattr(serve_command.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve_command.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve_command, "start_applications", start)
    for name in ("HEADROOM_API_KEY", "HEADROOM_API_KEY_FILE"):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    return calls


def test_serve_whose_replicas_cannot_be_placed_exits_2_before_any_application_starts(monkeypatch, capsys):
    # Serve waited for the third replica on a 2-CPU node without end ("taken more than 30s to be
    # scheduled"), and `headroom serve` with it.
    def start(config):
        raise AssertionError("an application started")

    calls = fake_ray(monkeypatch, {"CPU": 2.0}, start)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", "--replicas", "3", *proxy_port_flags()])
    assert exited.value.code == 2
    assert calls == ["ray.init", "ray.shutdown"]
    err = capsys.readouterr().err
    assert "error: --replicas: 3 replicas need 3 CPUs to start, the Ray cluster has 2 (--num-cpus sets the local " \
           "node's); pass --replicas 2\n" in err


def test_a_signal_while_the_applications_start_stops_the_cluster(monkeypatch, capsys):
    # Ctrl-C or SIGTERM only set an event that was read once every application ran: while
    # Serve waited for a replica (for ever, for one it could not place) nothing stopped it.
    def start(config):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("the signal did not interrupt the start")

    calls = fake_ray(monkeypatch, {"CPU": 8.0}, start)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        started = time.monotonic()
        assert main(["serve", "--model", "builtin", "--replicas", "1", *proxy_port_flags()]) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert calls == ["ray.init", "serve.shutdown", "ray.shutdown"]
    assert "interrupted while starting; stopping" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_serve_prints_its_endpoints_serves_and_stops_cleanly_on_sigint():
    # --api-key reaches Serve's proxy (in a Ray worker) through the environment Ray inherits.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("HEADROOM_API_KEY") and key != "RAY_AUTH_MODE"}  # Ray's own default: token auth
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", "builtin", "--replicas", "1", "--num-cpus", "2",
         "--http-port", "28300", "--grpc-port", "28301", "--max-model-len", "128", "--num-kv-blocks", "32",
         "--api-key", "serve-key"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        printed = []
        for line in process.stdout:  # endpoints are printed once every application runs
            printed.append(line)
            if line.startswith("serving;"):
                break
        text = "".join(printed)
        assert re.search(r"HTTP  http://\S+:28300/v1", text) and re.search(r"gRPC  \S+:28301", text), text
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
        with grpc.insecure_channel("127.0.0.1:28301") as channel:
            stub = pb_grpc.GenerationStub(channel)
            responses = list(stub.Generate(request, timeout=60, metadata=(("authorization", "Bearer serve-key"),)))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=60))
        assert responses[-1].usage.completion_tokens == 3
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "cert.pem"], "error: --tls-cert and --tls-key: give both"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
     "error: --tls-cert: no such file /nonexistent/cert.pem"),
    (["--api-key", "a,b"], "error: --api-key: an API key cannot contain ','"),
])
def test_serve_with_unusable_tls_or_key_flags_exits_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_certificate_whose_key_does_not_match(tmp_path, capsys):
    from tests.cluster.tls_harness import self_signed_certificate

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    cert, _ = self_signed_certificate(tmp_path / "one")
    _, other_key = self_signed_certificate(tmp_path / "two")
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", "--tls-cert", str(cert), "--tls-key", str(other_key)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: --tls-cert and --tls-key: not a PEM certificate and its matching private key" in err
    assert len(err.strip().splitlines()) == 2


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"]])
def test_an_unusable_tls_ca_file_exits_2_naming_the_flag(command, tmp_path, capsys):
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for path, problem in ((tmp_path / "absent.pem", "cannot read {}: No such file or directory"),
                          (not_pem, "{} holds no PEM certificate")):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--target", "127.0.0.1:1", "--tls-ca-cert", str(path)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"error: --tls-ca-cert: {problem.format(path)}" in err and len(err.strip().splitlines()) == 2


NGINX = shutil.which("nginx")


def listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed: README's nginx block stays an example")
def test_the_readmes_nginx_block_carries_grpc_over_tls_to_headroom_generate(tmp_path, capsys):
    """README's nginx server block, as written (its port, files and backend swapped for this
    test's), terminating TLS in front of `headroom replica`; `headroom generate --tls-ca-cert`
    through it, its API key passed on as metadata and the replica's refusal passed back."""
    from tests.cluster.tls_harness import self_signed_certificate

    block = re.search(r"```nginx\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S).group(1)
    cert, key = self_signed_certificate(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nginx_port = probe.getsockname()[1]
    process, port = start_replica("--api-key", "nginx-key")
    server = block
    for written, here in (("listen 443 ", f"listen 127.0.0.1:{nginx_port} "), (" cert.pem;", f" {cert};"),
                          (" key.pem;", f" {key};"), ("127.0.0.1:9000", f"127.0.0.1:{port}")):
        assert written in server, written
        server = server.replace(written, here)
    config = tmp_path / "nginx.conf"
    # Everything nginx writes, in this test's directory (a packaged nginx writes under /var).
    temp_paths = "".join(f"{kind}_temp_path {tmp_path}/{kind};\n"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    config.write_text(f"pid {tmp_path}/nginx.pid;\ndaemon off;\nevents {{}}\nhttp {{\n"
                      f"access_log {tmp_path}/access.log;\n{temp_paths}{server}}}\n")
    nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(config)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not listens(nginx_port):
            assert nginx.poll() is None, nginx.stderr.read()
            assert time.monotonic() < deadline, "nginx never listened"
            time.sleep(0.1)
        generate = ["generate", "hi", "--target", f"localhost:{nginx_port}", "--tls-ca-cert", str(cert),
                    "--max-tokens", "3", "--timeout-s", "60"]
        assert main([*generate, "--api-key", "nginx-key"]) == 0
        assert main(generate) == 1
        assert "UNAUTHENTICATED: missing or invalid API key" in capsys.readouterr().err
        # The probe: both calls crossed nginx (which logs a call once it has ended on its side too).
        deadline = time.monotonic() + 10
        while (tmp_path / "access.log").read_text().count("/headroom.v1.Generation/Generate HTTP/2.0") < 2:
            assert time.monotonic() < deadline, (tmp_path / "access.log").read_text()
            time.sleep(0.1)
    finally:
        stop(nginx)
        stop(process)


def test_a_bad_flag_is_one_line_naming_it_not_forty_lines_of_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-num-seqs", "many"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0].startswith("headroom serve: error: argument --max-num-seqs: invalid int value")
    assert len(lines) == 2 and "usage:" not in err


def test_generate_escapes_control_characters_but_keeps_newlines_and_tabs():
    from cluster.generate_command import terminal_safe

    assert terminal_safe("ok\x1b]0;pwned\x07\b\r\n\tdone\x9b") == "ok\\x1b]0;pwned\\x07\\x08\\x0d\n\tdone\\x9b"
    assert terminal_safe("héllo ✓") == "héllo ✓"


@pytest.mark.parametrize("argv, message", [
    # Each was sent on: the server's DEADLINE_EXCEEDED (exit 1), a traceback, or all at once.
    (["generate", "hi", "--timeout-s", "nan"],
     "headroom generate: error: argument --timeout-s: invalid value 'nan': a number of seconds > 0"),
    (["generate", "hi", "--timeout-s", "-1"],
     "headroom generate: error: argument --timeout-s: invalid value '-1': a number of seconds > 0"),
    (["bench", "--trace-scale", "nan"], "headroom bench: error: argument --trace-scale: invalid value 'nan': a number > 0"),
    (["bench", "--prompt-tokens", "0"], "headroom bench: error: argument --prompt-tokens: invalid value '0': an integer >= 1"),
    (["bench", "--trace", "{short}"], "headroom bench: error: --trace: {short}: not a trace ("),
    (["bench", "--trace", "{missing}"], "headroom bench: error: --trace: {missing} is not a file"),
])
def test_a_client_commands_bad_flag_exits_2_naming_it_before_any_call(argv, message, tmp_path, capsys):
    short = tmp_path / "short.csv"  # a row short of a column: was int(None)'s TypeError traceback
    short.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374\n")
    paths = {"short": short, "missing": tmp_path / "missing.csv"}
    with pytest.raises(SystemExit) as exited:
        main([arg.format(**paths) for arg in argv] + ["--target", "127.0.0.1:1"])
    assert exited.value.code == 2
    assert message.format(**paths) in capsys.readouterr().err


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (the kernel's picks)."""
    sockets = [socket.socket() for _ in range(count)]
    for held in sockets:
        held.bind(("127.0.0.1", 0))
    ports = [held.getsockname()[1] for held in sockets]
    for held in sockets:
        held.close()
    return ports


def proxy_port_flags() -> list[str]:
    http_port, grpc_port = free_ports(2)
    return ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]


@pytest.mark.parametrize("flags, config, message", [
    # Each started Ray, then every replica's engine core refused it in turn under Serve's
    # retries, and `headroom serve` ended in a traceback (exit 1); `headroom replica` said it in one line.
    (["--max-model-len", "4096"], None, "error: engine.max_model_len: 4096 exceeds the model's 2048\n"),
    ([], {"applications": [{"name": "a", "args": {"model": "builtin"}},
                           {"name": "b", "route_prefix": "/b", "args": {"model": "builtin",
                                                                         "engine": {"max_model_len": 4096}}}]},
     "error: applications[1].args.engine.max_model_len: 4096 exceeds the model's 2048\n"),
])
def test_serve_refuses_an_engine_setting_the_model_cannot_hold_before_ray_starts(flags, config, message, tmp_path,
                                                                                  monkeypatch, capsys):
    from cluster import serve_command

    def stop_before_ray(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(serve_command, "init_local_ray", stop_before_ray)
    config_flags = []
    if config is not None:
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
        config_flags = ["--config", str(tmp_path / "serve.yaml")]
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", "--replicas", "1", *config_flags, *proxy_port_flags(), *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_device_cuda_for_replicas_that_reserve_no_gpu():
    # Ray hides every GPU from such a replica: each failed its start in turn, under Serve.
    from cluster.serve_command import check_resources_fit
    from replica.config import ConfigError

    check_resources_fit(load_config({"device": "cuda", "replicas": {"num_replicas": 1}}), {"CPU": 2.0, "GPU": 1.0})
    for document, resources, message in [
        ({"device": "cuda"}, {"CPU": 8.0}, "device: cuda, but a replica reserves no GPU (the Ray cluster has none)"),
        ({"device": "cuda", "replicas": {"num_gpus": 0}}, {"CPU": 8.0, "GPU": 1.0},
         "device: cuda, but a replica reserves no GPU (replicas.num_gpus is 0)"),
    ]:
        with pytest.raises(ConfigError) as raised:
            check_resources_fit(load_config(document), resources)
        assert str(raised.value) == message


@pytest.mark.parametrize("flags, message", [
    # A machine with one GPU: the default two replicas named config fields nobody had written.
    ([], "error: --replicas: 2 replicas (the default) need 2 GPUs to start, the Ray cluster has 1; "
         "pass --replicas 1\n"),
    (["--replicas", "3"], "error: --replicas: 3 replicas need 3 GPUs to start, the Ray cluster has 1; pass --replicas 1\n"),
    (["--autoscaling", "headroom", "--min-replicas", "2"],
     "error: --min-replicas: 2 replicas need 2 GPUs to start, the Ray cluster has 1; pass --min-replicas 1\n"),
])
def test_serve_with_more_replicas_than_gpus_names_the_flag_that_fixes_it(flags, message, monkeypatch, capsys):
    def start(config):
        raise AssertionError("an application started")

    calls = fake_ray(monkeypatch, {"CPU": 8.0, "GPU": 1.0}, start)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", *proxy_port_flags(), *flags])
    assert exited.value.code == 2
    assert calls == ["ray.init", "ray.shutdown"]
    assert message in capsys.readouterr().err


def test_an_application_serve_cannot_deploy_is_one_line_and_exit_1(monkeypatch, capsys):
    # Was serve.run_many's RuntimeError traceback, which named the deployment but not why.
    from types import SimpleNamespace

    from cluster import serve_command

    def start(config):
        raise RuntimeError("Deploying application builtin failed: Failed to update the deployments ['LLMReplica'].")

    calls = fake_ray(monkeypatch, {"CPU": 8.0}, start)
    failed = SimpleNamespace(status="DEPLOY_FAILED", message=(
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
        "initial health check failing. See controller logs for details. Error:\n"
        "ray::ServeReplica:builtin:LLMReplica.initialize_and_get_metadata() (pid=1, ip=127.0.0.1)\n"
        "  File \"replica/front/core_client.py\", line 103, in start\n"
        "replica.config.ConfigError: num_host_kv_blocks: 4 blocks of 100 bytes exceed its container's memory limit\n"))
    monkeypatch.setattr(serve_command.serve, "status", lambda: SimpleNamespace(applications={
        "builtin": SimpleNamespace(deployments={"LLMReplica": failed, "Ingress": SimpleNamespace(
            status="UPDATING", message="")})}))
    assert main(["serve", "--model", "builtin", "--replicas", "1", *proxy_port_flags()]) == 1
    assert calls == ["ray.init", "serve.shutdown", "ray.shutdown"]
    assert capsys.readouterr().err.splitlines() == [
        "headroom serve: error: Deploying application builtin failed: Failed to update the deployments "
        "['LLMReplica'].; replica.config.ConfigError: num_host_kv_blocks: 4 blocks of 100 bytes exceed its "
        "container's memory limit"]


def test_serve_refuses_a_proxy_port_already_taken_before_ray_starts(tmp_path, monkeypatch, capsys):
    # Was a traceback once Ray had started (Serve's proxy failing to bind).
    from cluster import serve_command

    def stop_before_ray(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(serve_command, "init_local_ray", stop_before_ray)
    free_port, other_port = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"model": "builtin", "ports": {"http": port}}))
        for argv, message in [
            (["--model", "builtin", "--http-port", str(port), "--grpc-port", str(free_port)],
             f"error: --http-port: 127.0.0.1:{port} is in use (another headroom serve?); choose another port\n"),
            (["--model", "builtin", "--http-port", str(free_port), "--grpc-port", str(port)],
             f"error: --grpc-port: 0.0.0.0:{port} is in use"),
            (["--config", str(tmp_path / "serve.yaml"), "--grpc-port", str(free_port)],
             f"error: http_options.port: 127.0.0.1:{port} is in use"),
        ]:
            with pytest.raises(SystemExit) as exited:
                main(["serve", *argv])
            assert exited.value.code == 2
            assert message in capsys.readouterr().err
        with pytest.raises(RayWouldStart):  # both free
            main(["serve", "--model", "builtin", "--http-port", str(free_port), "--grpc-port", str(other_port)])


@pytest.mark.parametrize("flags, message", [
    # Plain ints: the errors named config fields (replicas.num_replicas), or a port Serve refused late.
    (["--replicas", "0"], "argument --replicas: invalid value '0': an integer >= 1"),
    (["--min-replicas", "0"], "argument --min-replicas: invalid value '0': an integer >= 1"),
    (["--max-replicas", "-1"], "argument --max-replicas: invalid value '-1': an integer >= 1"),
    (["--http-port", "70000"], "argument --http-port: invalid value '70000': a port, 1-65535"),
    (["--grpc-port", "0"], "argument --grpc-port: invalid value '0': a port, 1-65535"),
    (["--admission-max-hold-ms", "never"], "argument --admission-max-hold-ms: invalid float value: 'never'"),
])
def test_serve_replica_and_port_flags_are_refused_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "builtin", *flags])
    assert exited.value.code == 2
    assert f"headroom serve: error: {message}\n" in capsys.readouterr().err


def test_an_engine_flag_whose_none_means_something_takes_none():
    # admission_max_hold_ms's None (holds unbounded) could only be written in a config file.
    from cluster.engine_args import engine_config_from_args

    for value in ("none", "None", "NONE"):
        args = build_parser().parse_args(["replica", "--admission-max-hold-ms", value])
        assert engine_config_from_args(args).admission_max_hold_ms is None
    args = build_parser().parse_args(["serve", "--model", "builtin", "--admission-max-hold-late-ms", "none"])
    assert serve_config_from_args(args).applications[0].args.engine.admission_max_hold_late_ms is None
    # A choice spelled "none" stays itself, and an unset flag keeps the default.
    args = build_parser().parse_args(["replica", "--generation-config", "none", "--admission-max-hold-ms", "250"])
    config = engine_config_from_args(args)
    assert (config.generation_config, config.admission_max_hold_ms, config.admission_max_hold_late_ms) == (
        "none", 250.0, EngineConfig().admission_max_hold_late_ms)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by whoever inherited it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _replica_building_its_engine(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`headroom replica` whose engine core is building an engine that takes minutes; its core's pid."""
    from tests.cluster.slow_engine import SLOW_ENGINE_ENV

    mark = tmp_path / "core-pid"
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "replica", "--model", "builtin", "--port", "0",
         "--engine-factory", "tests.cluster.slow_engine:slow_engine"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, SLOW_ENGINE_ENV: str(mark)},
    )
    deadline = time.monotonic() + 120
    while not mark.exists() or not mark.read_text():
        assert process.poll() is None and time.monotonic() < deadline, "the engine core never began building"
        time.sleep(0.1)
    return process, int(mark.read_text())


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_replica_starts_stops_its_engine_core_and_exits_130(tmp_path):
    # The core (which ignores SIGINT: Ctrl-C reaches the whole process group) built on, alone,
    # for as long as its engine took, after the command had exited with a traceback.
    process, core_pid = _replica_building_its_engine(tmp_path)
    try:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 128 + signal.SIGINT
        assert _wait_gone(core_pid, 5)
        assert "Traceback" not in process.stderr.read()
    finally:
        stop(process)
        if _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_an_engine_core_dies_with_its_front_even_while_it_builds(tmp_path):
    # A front killed outright (SIGKILL, the OOM killer, Ray killing an actor) while its core
    # built the engine left the core building, and holding its memory, for nothing.
    process, core_pid = _replica_building_its_engine(tmp_path)
    try:
        process.kill()
        process.wait(timeout=30)
        assert _wait_gone(core_pid, 5)
    finally:
        stop(process)
        if _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_ctrl_c_in_a_client_command_exits_130_without_a_traceback():
    # Was KeyboardInterrupt's traceback (generate mid-stream, bench, serve before Ray).
    with socket.socket() as silent:  # a server that accepts the connection and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "generate", "hi", "--target", f"127.0.0.1:{silent.getsockname()[1]}"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            connection, _ = silent.accept()  # generate is in its call
            with connection:
                process.send_signal(signal.SIGINT)
                assert process.wait(timeout=30) == 128 + signal.SIGINT
            assert process.stderr.read() == "" and process.stdout.read() == ""
        finally:
            stop(process)


def test_generate_into_a_closed_pipe_stops_quietly_as_unix_tools_do(tmp_path):
    # `headroom generate ... | head -c5`: was BrokenPipeError's traceback.
    replica, port = start_replica()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "generate", "hi", "--target", f"127.0.0.1:{port}",
             "--max-tokens", "4"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        process.stdout.close()  # the reader has gone before the first token
        assert process.wait(timeout=60) == 128 + signal.SIGPIPE
        assert process.stderr.read() == ""
    finally:
        stop(replica)
