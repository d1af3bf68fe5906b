"""Stop strings matched on detokenized text as it streams: a string split across token (or
delta) boundaries still matches, and text that could be the start of a stop string is held
back until the next delta tells whether it is one, so no client ever sees part of it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence


class StopMatch(NamedTuple):
    """What a delta releases: the text to emit, and the stop string it ended on (if any)."""

    text: str
    stop: Optional[str] = None


class StopStringMatcher:
    """Fed one request's text deltas in order (`feed`); once a stop string appears, the text
    before it (plus the string itself with `include_in_output`) is the last text released.
    `flush` releases what is held back when the request ends for another reason."""

    def __init__(self, stop: Sequence[str], include_in_output: bool = False):
        if not stop or not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._include_in_output = include_in_output
        self._held = ""  # a suffix of the text so far that some stop string starts with
        self.stopped: Optional[str] = None

    def feed(self, delta: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("")
        text = self._held + delta
        match = self._earliest_match(text)
        if match is not None:
            position, stop = match
            self.stopped, self._held = stop, ""
            end = position + len(stop) if self._include_in_output else position
            return StopMatch(text[:end], stop)
        held = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - held:] if held else ""
        return StopMatch(text[: len(text) - held])

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> Optional[tuple[int, str]]:
        # Held text never contains a whole stop string, so a match can only end in the new
        # delta. The one completed first wins (then the earliest start), as it would if the text
        # came a character at a time: which stop ended a request (`abcd` or `bc` in `xabcdy`)
        # depended on how the text was cut into deltas, by tokens or by stream_interval.
        best: Optional[tuple[int, int, str]] = None
        for stop in self._stop:
            position = text.find(stop)
            if position >= 0 and (best is None or (position + len(stop), position) < best[:2]):
                best = (position + len(stop), position, stop)
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - length:]):
                    longest = length
                    break
        return longest
