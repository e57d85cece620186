from __future__ import annotations

from pdserve.model_runtime.sampling.stop import StopStringMatcher


def feed_all(m: StopStringMatcher, deltas: list[str]) -> str:
    out = ""
    for d in deltas:
        out += m.feed(d)
        if m.matched:
            break
    return out + m.flush()


def test_stop_string_straddling_two_tokens_is_cut() -> None:
    m = StopStringMatcher(("STOP",))
    assert feed_all(m, ["hello S", "TO", "P and more"]) == "hello "
    assert m.matched == "STOP"


def test_include_stop_string() -> None:
    m = StopStringMatcher(("\n\n",), include_stop=True)
    assert feed_all(m, ["a\n", "\nb"]) == "a\n\n"


def test_text_that_only_starts_like_a_stop_is_released() -> None:
    m = StopStringMatcher(("abc",))
    assert m.feed("xxab") == "xx"  # "ab" might begin "abc": held back
    assert m.feed("d") == "abd"  # "abd" cannot: all of it is released
    assert m.feed("xa") == "x"
    assert m.flush() == "a"
    assert m.matched is None


def test_earliest_of_several_stops_wins() -> None:
    m = StopStringMatcher(("world", "lo w"))
    assert feed_all(m, ["hello world"]) == "hel"
    assert m.matched == "lo w"


def test_no_stops_passes_everything_through() -> None:
    m = StopStringMatcher(())
    assert m.feed("abc") == "abc"
    assert m.flush() == ""
