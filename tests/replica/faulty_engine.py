"""An engine for the engine-core process whose next step fails once, on demand: a test writes
"forward" (the forward pass raises, as an out-of-memory error would) or "complete" (waiting for
a step's tokens raises, as a device error surfacing at the step's synchronization would) into
the file HEADROOM_TEST_FAIL_ONCE names; the core (which inherits the test's environment and
sys.path) builds it with engine_factory="faulty_engine:FailsOnce"."""

from __future__ import annotations

import os
from pathlib import Path

from replica.core.engine import LLMEngine

FAIL_ONCE_ENV = "HEADROOM_TEST_FAIL_ONCE"


def _take(where: str) -> bool:
    """Whether the failure asked for is this one; taken at most once."""
    path = Path(os.environ[FAIL_ONCE_ENV])
    if path.exists() and path.read_text() == where:
        path.unlink()
        return True
    return False


class FailsOnce(LLMEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        forward = self.runner._forward

        def failing_forward(*args, **kwargs):
            if _take("forward"):
                raise RuntimeError("injected: the forward pass failed")
            return forward(*args, **kwargs)

        self.runner._forward = failing_forward

    def _complete(self, launched, as_rows):
        if _take("complete"):
            raise RuntimeError("injected: waiting for the step's tokens failed")
        return super()._complete(launched, as_rows)
