"""The light surface (issue 21): the ingress, the router, the CLI, the replica's config and
errors import without torch, so a process that routes or validates never pays for the model
stack; and a replica's front and the ingress run without it: nothing the engine core sends
the front, and nothing the ingress does per request, needs torch. Run in a fresh interpreter
where importing torch (or triton) fails."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import importlib, sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'triton'):
            raise ImportError(f'torch is blocked in this test: {name}')
sys.meta_path.insert(0, BlockTorch())
"""

BLOCK_TORCH = BLOCKER + """
for module in sys.argv[1:]:
    importlib.import_module(module)
assert 'torch' not in sys.modules
print('imported', len(sys.argv) - 1)
"""

LIGHT_MODULES = ("cluster.ingress", "cluster.deployment", "cluster.config", "cluster.cli", "cluster.replica_command",
                 "cluster.serve_command", "router",
                 "router.serve_router", "replica.config", "replica.errors", "replica.core.load",
                 "replica.server.metrics", "replica.model.registry")

# A front in this process (its engine core is a process of its own, with torch): the core's
# start-up answer, every per-step message (rows with logprobs, load, KV events, a rejected add),
# utility results and errors, and two start-up failures, all unpickled here.
FRONT = BLOCKER + """
import asyncio
from replica.config import ConfigError, make_engine_config
from replica.core.request import SamplingParams
from replica.errors import InvalidRequestError
from replica.front.async_engine import AsyncEngine
from replica.model import ModelLoadError

CONFIG = make_engine_config(max_model_len=128, num_kv_blocks=32)

async def serve():
    front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu")
    try:
        assert front.engine.model_config.dtype == "float32"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
        outputs = [output async for output in front.generate([5, 6, 7, 8] * 5, params)]
        assert sum(len(output.new_token_ids) for output in outputs) == 6 and outputs[-1].finish_reason == "length"
        assert all(len(top.token_ids) == 2 for output in outputs for top in output.top_logprobs)
        assert await front.kv_events.batches_after(None), "no KV events reached the front"
        assert (await front.core.call_utility("counters"))["generation_tokens"] == 6
        try:
            await front.core.call_utility("no_such_utility")
            raise AssertionError("a utility error did not cross")
        except ValueError:
            pass
        # The front trusts its edge; the core's scheduler refuses what its block tables cannot hold.
        try:
            [output async for output in front.generate(list(range(3, 203)), SamplingParams(max_tokens=4))]
            raise AssertionError("an add the core refuses was served")
        except InvalidRequestError as error:
            assert error.field == "prompt", error
    finally:
        await front.shutdown(grace_period_s=0)

async def refused(model, bad_config, expected):
    try:
        await AsyncEngine.launch(bad_config, model, device="cpu")
        raise AssertionError(f"{model} started")
    except expected:
        pass

async def main():  # the three engine cores start side by side (each its own process)
    await asyncio.gather(serve(), refused("builtin", make_engine_config(max_model_len=1 << 20, num_kv_blocks=(1 << 16) + 1),
                                          ConfigError), refused(sys.argv[1], CONFIG, ModelLoadError))

asyncio.run(main())
assert 'torch' not in sys.modules
print('served without torch')
"""

# What the ingress does per request, on the default model (a GGUF converted once, found again).
INGRESS = BLOCKER + """
from replica.core.outputs import RequestOutput
from replica.core.request import SamplingParams, validate_request
from replica.core.structured_output import GrammarCompiler, StructuredOutput
from replica.model.registry import resolve_model_path
from replica.server.grpc_service import generate_response
from replica.text.tokenizer import Tokenizer

tokenizer = Tokenizer.from_pretrained(resolve_model_path(sys.argv[1]))
prompt = tokenizer.encode("The capital of France is")
validate_request(prompt, SamplingParams(max_tokens=8), max_model_len=2048, vocab_size=49152)
grammars = GrammarCompiler.for_tokenizer(tokenizer, 49152, [2])
grammars.check(StructuredOutput("regex", "[0-9]+"), "regex")
grammars.shutdown()
response = generate_response(RequestOutput("r", [42], " Paris", "length", len(prompt), 1, 0), "replica-a")
assert response.text == " Paris"
assert 'torch' not in sys.modules
print('ingress work without torch')
"""


def run_blocked(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_ingress_the_router_and_the_config_import_without_torch():
    result = run_blocked(BLOCK_TORCH, *LIGHT_MODULES)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"imported {len(LIGHT_MODULES)}"


def test_the_blocker_really_blocks_torch():
    # The probe: the same interpreter set-up fails on a module that needs the model.
    result = run_blocked(BLOCK_TORCH, "replica.core.engine")
    assert result.returncode != 0 and "torch is blocked in this test" in result.stderr


def test_a_front_serves_and_fails_to_start_without_importing_torch(tmp_path):
    from replica.model.registry import resolve_model_path

    builtin = resolve_model_path("builtin")  # made here (its weights need torch) before the front runs
    weightless = tmp_path / "weightless"
    shutil.copytree(builtin, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    result = run_blocked(FRONT, str(weightless))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("served without torch")


def test_the_ingress_tokenizes_validates_compiles_and_answers_without_torch(smollm2_dir):
    # smollm2_dir: the packaged GGUF fetched and converted (with torch) before the ingress looks.
    result = run_blocked(INGRESS, "smollm2-135m")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ingress work without torch"


def test_errors_cross_to_the_front_as_themselves_or_named():
    import torch

    from replica.config import ConfigError
    from replica.errors import QueueFullError
    from replica.ipc.messages import error_for_front
    from replica.model import ModelLoadError

    for error in (ConfigError("max_model_len: too long"), ModelLoadError("weights: missing"), QueueFullError("full"),
                  ValueError("method: no utility")):
        assert error_for_front(error) is error
    oom = error_for_front(torch.OutOfMemoryError("CUDA out of memory"))
    assert type(oom) is RuntimeError and str(oom) == "OutOfMemoryError: CUDA out of memory"


# What cluster/ and router/ may import from replica/: its light roots (config, errors, the
# model registry, the checkpoint's torch-free reading, the model config's shape arithmetic), the request and output types the ingress builds and streams, the front a
# Serve replica embeds and the server pieces it runs beside it (and the core client's child
# environment, which `headroom replica` starts its other fronts with). Never the engine core's
# scheduler, KV cache, executor or model internals: those stay behind the front's process
# boundary. A new import from replica/ in cluster/ or router/ lands here on purpose, or not.
REPLICA_SURFACE = {
    "replica.config", "replica.errors", "replica.model", "replica.model.checkpoint", "replica.model.config",
    "replica.model.registry",
    "replica.core.request", "replica.core.outputs", "replica.core.structured_output", "replica.core.process",
    "replica.ipc.messages", "replica.front.async_engine", "replica.front.core_client", "replica.text.tokenizer",
    "replica.server.auth", "replica.server.grpc_reflection", "replica.server.grpc_service", "replica.server.metrics",
    "replica.server.replica_server", "replica.server.request_limits", "replica.server.status",
}


def replica_imports(package: str) -> dict[str, set[str]]:
    """Each replica module that a file of `package` imports (at the top or inside a function)."""
    imported: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [])
            for name in names:
                if name == "replica" or name.startswith("replica."):
                    imported.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return imported


def test_the_cluster_and_the_router_import_only_the_replica_surface():
    imported = {**replica_imports("cluster"), **replica_imports("router")}
    assert "replica.config" in imported and "replica.server.metrics" in imported  # the walk sees imports
    outside = {module: sorted(files) for module, files in imported.items() if module not in REPLICA_SURFACE}
    assert not outside, f"replica internals imported by cluster/ or router/: {outside}"
