"""How long a live request's output will still grow, learned from the requests this replica
finished: a window of their output lengths, of which those cut off by max_tokens only say
"at least this long" (the request would have gone on).

expected_final(k, m) is E[min(N, m) | N > k] for a request that has produced k tokens with
max_tokens m, N being its natural length: stopped requests longer than k count with
min(length, m), cut-off ones whose cap exceeds k count as m (their natural length is at
least their cap; for a smaller cap than m that is the cautious reading), beside two
pseudo-requests that run to m. With nothing learned the answer is m, and with little
learned about requests this long it stays near m: the estimate errs towards reserving too
much.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

OUTPUT_LENGTH_WINDOW = 1024  # finished requests remembered
# The sorted view that queries read is rebuilt once this fraction of the window is new:
# the distribution moves slowly, and rebuilding per finished request would cost O(window).
REBUILD_FRACTION = 1 / 32
PRIOR_AT_CAP = 2


class OutputLengthEstimator:
    def __init__(self, window: int = OUTPUT_LENGTH_WINDOW):
        self._finished: deque[tuple[int, bool]] = deque(maxlen=window)  # (output tokens, hit max_tokens)
        self._changes = 0
        self._stopped: list[int] = []  # sorted lengths of requests that stopped on their own
        self._stopped_sums: list[int] = [0]  # prefix sums of _stopped
        self._capped: list[int] = []  # sorted lengths of requests cut off at max_tokens

    def observe(self, num_output_tokens: int, hit_max_tokens: bool) -> None:
        """One finished request (aborted ones say nothing about length and are not observed)."""
        self._finished.append((num_output_tokens, hit_max_tokens))
        self._changes += 1

    def _refresh(self) -> None:
        if self._changes == 0 or self._changes < REBUILD_FRACTION * len(self._finished):
            return
        self._stopped = sorted(length for length, capped in self._finished if not capped)
        self._stopped_sums = [0, *itertools.accumulate(self._stopped)]
        self._capped = sorted(length for length, capped in self._finished if capped)
        self._changes = 0

    def expected_final(self, num_output_tokens: int, max_tokens: int) -> int:
        """Expected total output tokens of a live request, in [num_output_tokens + 1, max_tokens]."""
        k, m = num_output_tokens, max_tokens
        if k + 1 >= m:
            return m
        self._refresh()
        stopped, sums = self._stopped, self._stopped_sums
        above_k = bisect.bisect_right(stopped, k)
        up_to_m = max(bisect.bisect_right(stopped, m), above_k)
        # PRIOR_AT_CAP pseudo-requests that run to the cap keep a few long survivors from
        # setting the estimate alone (the first requests to finish are the short ones).
        num_capped = len(self._capped) - bisect.bisect_right(self._capped, k) + PRIOR_AT_CAP
        num_samples = len(stopped) - above_k + num_capped
        total = sums[up_to_m] - sums[above_k] + m * (len(stopped) - up_to_m + num_capped)
        expected = -(-total // num_samples)
        return min(m, max(k + 1, expected))
