"""An engine factory for the engine-core process that never finishes building: it writes the
core's pid into the file $HEADROOM_TEST_SLOW_ENGINE names, then sleeps, as a large model's
load would (reading no channel meanwhile). `headroom replica --engine-factory
tests.cluster.slow_engine:slow_engine` (the core inherits the command's sys.path)."""

from __future__ import annotations

import os
import time
from pathlib import Path

SLOW_ENGINE_ENV = "HEADROOM_TEST_SLOW_ENGINE"
# Far longer than any test waits: a core still here when the test looks was not stopped.
BUILD_S = 300.0


def slow_engine(*args, **kwargs):
    Path(os.environ[SLOW_ENGINE_ENV]).write_text(str(os.getpid()))
    time.sleep(BUILD_S)
    raise RuntimeError("the slow engine's build ended")
