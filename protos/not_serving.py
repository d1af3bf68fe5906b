"""Part of the wire contract (see the LoadReporter service in headroom.proto): the trailing
metadata with which a replica that can serve nothing more ends its LoadReporter calls, so
routers take it out of rotation at once. A dead engine core fails every request fast, so a
router that only saw its queue would send it more traffic (a "black hole"), not less.
"""

from __future__ import annotations

from typing import Optional

NOT_SERVING_KEY = "headroom-not-serving"
ENGINE_CORE_DIED = "engine-core-died"
SHUTTING_DOWN = "shutting-down"


def not_serving_metadata(reason: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a replica ends its LoadReporter calls with, giving `reason`."""
    return ((NOT_SERVING_KEY, reason),)


def not_serving_reason(trailing_metadata) -> Optional[str]:
    """The reason a replica's trailing metadata gives for serving nothing more, else None."""
    for key, value in trailing_metadata or ():
        if key == NOT_SERVING_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None
