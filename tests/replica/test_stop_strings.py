"""StopStringMatcher: a stop string split across deltas still matches, the text that could
begin one is held back until it is known not to, and the string is left out of the output
(or kept, when asked)."""

from __future__ import annotations

import pytest

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
