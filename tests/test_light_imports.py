"""The light surface (issue 21): the ingress, the router, the CLI, the replica's config and
errors import without torch, so a process that routes or validates never pays for the model
stack. Run in a fresh interpreter where importing torch (or triton) fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = """
import importlib, sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'triton'):
            raise ImportError(f'torch is blocked in this test: {name}')
sys.meta_path.insert(0, BlockTorch())
for module in sys.argv[1:]:
    importlib.import_module(module)
assert 'torch' not in sys.modules
print('imported', len(sys.argv) - 1)
"""

LIGHT_MODULES = ("cluster.ingress", "cluster.deployment", "cluster.config", "cluster.cli", "router",
                 "router.serve_router", "replica.config", "replica.errors", "replica.core.load",
                 "replica.server.metrics", "replica.model.registry")


def test_the_ingress_the_router_and_the_config_import_without_torch():
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *LIGHT_MODULES], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"imported {len(LIGHT_MODULES)}"


def test_the_blocker_really_blocks_torch():
    # The probe: the same interpreter set-up fails on a module that needs the model.
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "replica.core.engine"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "torch is blocked in this test" in result.stderr
