"""Stop strings matched on detokenized text as it streams: a string split across token (or
delta) boundaries still matches, and text that could be the start of a stop string is held
back until the next delta tells whether it is one, so no client ever sees part of it.
"""

from __future__ import annotations

import collections
from typing import NamedTuple, Optional, Sequence


class StopMatch(NamedTuple):
    """What a delta releases: the text to emit, and the stop string it ended on (if any)."""

    text: str
    stop: Optional[str] = None


class StopStringMatcher:
    """Fed one request's text deltas in order (`feed`); once a stop string appears, the text
    before it (plus the string itself with `include_in_output`) is the last text released.
    `flush` releases what is held back when the request ends for another reason.

    The strings are matched by one Aho-Corasick automaton, a character at a time: each
    character costs one transition (amortized) whatever the number and length of the stop
    strings, where rescanning the held text after each delta cost up to ~0.6 ms a token within
    the request limits (64 strings, 4,096 characters), on the front's event loop."""

    def __init__(self, stop: Sequence[str], include_in_output: bool = False):
        if not stop or not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._include_in_output = include_in_output
        self._automaton = _Automaton(stop)
        self._state = 0  # the automaton's node: the longest suffix of the text that starts a stop string
        self._held = ""  # that suffix: text no client has seen yet
        self.stopped: Optional[str] = None

    def feed(self, delta: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("")
        automaton = self._automaton
        children, fail, completes = automaton.children, automaton.fail, automaton.completes
        node = self._state
        for offset, char in enumerate(delta):
            while node and char not in children[node]:
                node = fail[node]
            node = children[node].get(char, 0)
            stop = completes[node]
            if stop is not None:
                # The stop string completed first wins, and of those completed by this
                # character the longest (the earliest start), as it would if the text came a
                # character at a time: which stop ended a request (`abcd` or `bc` in `xabcdy`)
                # never depends on how the text was cut into deltas.
                text = self._held + delta
                end = len(self._held) + offset + 1
                self.stopped, self._held, self._state = stop, "", 0
                return StopMatch(text[:end if self._include_in_output else end - len(stop)], stop)
        self._state = node
        text = self._held + delta
        held = automaton.depth[node]
        self._held = text[len(text) - held:] if held else ""
        return StopMatch(text[:len(text) - held])

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held


class _Automaton:
    """A trie of the stop strings with failure links: node 0 is the root; a node's depth is
    the length of the prefix it spells, its failure link the node of that prefix's longest
    proper suffix that is also a prefix of some stop string, and `completes` the longest stop
    string that is a suffix of it (None if none)."""

    def __init__(self, stops: Sequence[str]):
        self.children: list[dict[str, int]] = [{}]
        self.fail = [0]
        self.depth = [0]
        self.completes: list[Optional[str]] = [None]
        for stop in stops:
            node = 0
            for char in stop:
                child = self.children[node].get(char)
                if child is None:
                    child = self.children[node][char] = len(self.children)
                    self.children.append({})
                    self.fail.append(0)
                    self.depth.append(self.depth[node] + 1)
                    self.completes.append(None)
                node = child
            self.completes[node] = stop
        # Breadth first: a failure link points to a shallower node, whose own links are set.
        queue = collections.deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for char, child in self.children[node].items():
                link = self.fail[node]
                while link and char not in self.children[link]:
                    link = self.fail[link]
                target = self.children[link].get(char, 0)
                self.fail[child] = target if target != child else 0
                if self.completes[child] is None:  # its own string is longer than any suffix's
                    self.completes[child] = self.completes[self.fail[child]]
                queue.append(child)
