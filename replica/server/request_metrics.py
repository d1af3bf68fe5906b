"""RequestMetrics: the per-request latency histograms and finish-reason counts, observed
where AsyncEngine hands each output to its request's stream. Every front (the replica's
gRPC servicer, the Ray Serve deployment, tests driving AsyncEngine) passes there, so no
path can leave the histograms empty.
"""

from __future__ import annotations

from typing import Callable

from replica.core.outputs import RequestOutput
from replica.server.metrics import ReplicaMetrics
from replica.core.request import Request


class RequestMetrics:
    """Observes requests on the engine's clock as their outputs are dispatched: TTFT and
    queue time at the first token, inter-token latency between tokens, end-to-end latency
    and the finish reason at the last output (aborts count as finished "abort")."""

    def __init__(self, metrics: ReplicaMetrics, clock: Callable[[], float]):
        self.metrics = metrics
        self.clock = clock
        self._last_token_time: dict[str, float] = {}  # live requests that have streamed a token

    def on_output(self, request: Request, output: RequestOutput) -> None:
        now = self.clock()
        request_id = request.request_id
        if output.new_token_ids:
            last_token_time = self._last_token_time.get(request_id)
            if last_token_time is None:
                self.metrics.observe_ttft(now - request.arrival_time)
                if request.first_admitted_time is not None:
                    self.metrics.observe_queue_time(request.first_admitted_time - request.arrival_time)
            else:
                self.metrics.observe_itl(now - last_token_time)
            self._last_token_time[request_id] = now
        if output.finish_reason is not None:
            self._last_token_time.pop(request_id, None)
            if output.finish_reason != "abort":
                self.metrics.observe_e2e(now - request.arrival_time)
            self.metrics.finished(output.finish_reason)

    def on_failed(self, request: Request) -> None:
        """The request's stream ended with an error instead of a last output."""
        self._last_token_time.pop(request.request_id, None)
        self.metrics.finished("abort")
