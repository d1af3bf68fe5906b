"""StopStringMatcher: a stop string split across deltas still matches, the text that could
begin one is held back until it is known not to, and the string is left out of the output
(or kept, when asked)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from replica.text.stop_strings import StopMatch, StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    text, stop = "", None
    for delta in deltas:
        match = matcher.feed(delta)
        text += match.text
        stop = stop or match.stop
    if stop is None:
        text += matcher.flush()
    return text, stop


def test_a_stop_string_split_across_deltas_matches_and_is_left_out():
    assert feed_all(StopStringMatcher(["END"]), ["hello E", "N", "D and more"]) == ("hello ", "END")


def test_text_that_could_start_a_stop_string_is_held_back_until_it_cannot():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("one\n") == StopMatch("one")  # "\n" may be the first half
    assert matcher.feed("two") == StopMatch("\ntwo")  # it was not


def test_the_stop_string_completed_first_wins_however_the_text_is_cut():
    """As if the text came a character at a time: in one delta the earliest *start* won, so
    `xabcdy` stopped on "abcd" whole and on "bc" a character at a time (helper-40's fuzzing)."""
    assert feed_all(StopStringMatcher(["cd", "abc"]), ["xxabcd"]) == ("xx", "abc")
    for include in (False, True):
        outcomes = {feed_all(StopStringMatcher(["abcd", "bc"], include_in_output=include), deltas)
                    for deltas in (["xabcdy"], list("xabcdy"), ["xab", "cdy"], ["xa", "bcd", "y"])}
        assert outcomes == {("xabc" if include else "xa", "bc")}
    assert feed_all(StopStringMatcher(["bcd", "abcd"]), ["xabcdy"]) == ("x", "abcd")  # both end there: the earlier start


def test_include_in_output_keeps_the_stop_string():
    assert feed_all(StopStringMatcher(["."], include_in_output=True), ["Done. Then"]) == ("Done.", ".")


def test_without_a_match_every_character_comes_out_by_the_flush():
    assert feed_all(StopStringMatcher(["STOP"]), ["ST", "O", "P", "S", "T"]) == ("", "STOP")
    assert feed_all(StopStringMatcher(["STOP"]), ["ST", "OR", "Y ST"]) == ("STORY ST", None)


def test_nothing_comes_out_after_the_stop():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == StopMatch("a", "x")
    assert matcher.feed("more") == StopMatch("")
    assert matcher.stopped == "x"


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The definition, by brute force: the stop string completed first, then the longest of
    those completed there; the text before it (with it, `include`)."""
    for end in range(1, len(text) + 1):
        done = [stop for stop in stops if text[:end].endswith(stop)]
        if done:
            stop = max(done, key=len)
            return text[:end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6),
                                                              min_size=1, max_size=5),
       cuts=st.lists(st.integers(min_value=0, max_value=30)), include=st.booleans())
def test_the_matcher_is_its_definition_and_holds_back_exactly_what_could_still_be_a_stop(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    deltas = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stops, include)
    released, seen = "", ""
    for delta in deltas:
        match = matcher.feed(delta)
        released += match.text
        seen += delta
        if match.stop is not None:
            assert (released, match.stop) == reference(text, stops, include)
            return
        # Held back: the longest end of the text so far that begins a stop string, no more.
        held = seen[len(released):]
        assert held == max((seen[start:] for start in range(len(seen) + 1)
                            if any(stop.startswith(seen[start:]) and stop != seen[start:] for stop in stops)), key=len)
    assert (released + matcher.flush(), None) == reference(text, stops, include)
