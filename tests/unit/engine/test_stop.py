"""Stop strings across token boundaries: hold back only a possible prefix, never emit the stop."""
from __future__ import annotations

import pytest

from services.engine.stop import StopMatcher


def feed(m: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out, hit = [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit


def test_stop_split_across_deltas():
    m = StopMatcher(["</end>"])
    assert m.push("Hello </") == ("Hello ", False)  # "</" could start the stop string
    assert m.push("en") == ("", False)
    assert m.push("d> trailing") == ("", True)
    assert m.matched == "</end>"
    assert m.push("more") == ("", True)


def test_false_start_is_released():
    m = StopMatcher(["</end>"])
    assert m.push("a </e") == ("a ", False)
    assert m.push("x") == ("</ex", False)
    assert m.flush() == ""


def test_only_the_possible_prefix_is_held():
    m = StopMatcher(["abc"])
    assert m.push("xxab") == ("xx", False)
    assert m.push("ab") == ("ab", False)  # "abab": only the last "ab" can still start "abc"
    assert m.push("c!") == ("", True)


def test_earliest_of_several_stops_wins():
    text, hit = feed(StopMatcher(["world", "lo w"]), ["hel", "lo wor", "ld"])
    assert (text, hit) == ("hel", True)


def test_stop_inside_one_delta():
    assert feed(StopMatcher(["\n\n"]), ["line one\n\nline two"]) == ("line one", True)


def test_no_stop_emits_everything_after_flush():
    pieces = ["The ", "end", " is n", "ear", "."]
    assert feed(StopMatcher(["ending", "STOP"]), pieces) == ("The end is near.", False)


def test_empty_and_duplicate_stop_strings_are_ignored():
    m = StopMatcher(["", "x", "x"])
    assert m.stops == ("x",)
    assert StopMatcher([]).push("anything") == ("anything", False)


@pytest.mark.parametrize("split", range(1, 9))
def test_every_split_point_gives_the_same_result(split):
    text = "abc STOP def"
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    assert feed(StopMatcher(["STOP"]), pieces) == ("abc ", True)


def test_multibyte_stop_string():
    assert feed(StopMatcher(["。"]), ["你好", "。再见"]) == ("你好", True)
