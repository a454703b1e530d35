"""Stop strings: matched across deltas, held back while they may still match, never emitted (unless asked)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infer_server.stop_strings import StopStringMatcher


def _feed(stops: list[str], deltas: list[str], include_stop: bool = False) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops, include_stop)
    out = []
    for d in deltas:
        text, hit = m.push(d)
        out.append(text)
        if hit:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stops_passes_through() -> None:
    assert _feed([], ["a", "b"]) == (["a", "b", ""], False)


def test_match_across_token_boundaries() -> None:
    out, hit = _feed(["STOP"], ["Hello S", "T", "OP world"])
    assert hit
    assert "".join(out) == "Hello "
    assert out == ["Hello ", "", ""]  # "S" and "ST" were held back, the stop string never shown


def test_held_text_released_when_it_stops_matching() -> None:
    out, hit = _feed(["STOP"], ["a ST", "AR b"])
    assert not hit
    assert out == ["a ", "STAR b", ""]


def test_held_text_released_at_the_end() -> None:
    out, hit = _feed(["</s>"], ["done </"])
    assert not hit and out == ["done ", "</"]


def test_earliest_of_several_stops_wins() -> None:
    out, hit = _feed(["world", "lo w"], ["Hello world"])
    assert hit and out == ["Hel"]


def test_stop_inside_one_delta_cuts_the_rest() -> None:
    out, hit = _feed(["\n\n"], ["line one\n\nline two"])
    assert hit and out == ["line one"]


def test_overlapping_prefixes() -> None:
    out, hit = _feed(["aab"], ["xa", "a", "a", "b!"])
    assert hit and "".join(out) == "xa"


def test_empty_stop_strings_are_ignored() -> None:
    m = StopStringMatcher(["", ""])
    assert not m.active
    assert m.push("abc") == ("abc", False)


def test_after_hit_nothing_more() -> None:
    m = StopStringMatcher(["x"])
    assert m.push("ax") == ("a", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_include_stop_emits_the_matched_stop_string_and_nothing_after() -> None:
    out, hit = _feed(["STOP"], ["Hello S", "T", "OP world"], include_stop=True)
    assert hit and out == ["Hello ", "", "STOP"]
    out, hit = _feed(["\n\n"], ["line one\n\nline two"], include_stop=True)
    assert hit and out == ["line one\n\n"]


def test_include_stop_takes_the_longest_of_stops_starting_at_the_same_place() -> None:
    out, hit = _feed(["ab", "abc"], ["xabcd"], include_stop=True)
    assert hit and out == ["xabc"]
    out, hit = _feed(["abc", "ab"], ["xabcd"])
    assert hit and out == ["x"]


def _held_reference(stops: list[str], buf: str) -> int:
    """The definition: the longest tail of `buf` that is a proper prefix of some stop string."""
    return max([k for s in stops if s for k in range(1, len(s)) if k <= len(buf) and buf.endswith(s[:k])], default=0)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.text(alphabet="abx", min_size=0, max_size=6), min_size=1, max_size=4),
       st.lists(st.text(alphabet="abxy", max_size=5), max_size=8))
def test_held_text_is_exactly_the_longest_partial_match(stops: list[str], deltas: list[str]) -> None:
    """Whatever the stops and deltas: the matcher emits the text up to the earliest full match, holds back exactly
    the longest tail that could still grow into a stop, and emits everything when nothing matches."""
    m = StopStringMatcher(stops)
    text = ""
    emitted = ""
    for d in deltas:
        text += d
        out, hit = m.push(d)
        emitted += out
        if hit:
            firsts = [text.find(s) for s in stops if s and s in text]
            assert emitted == text[:min(firsts)]
            return
        assert not any(s and s in text for s in stops)
        assert emitted + m.held == text and len(m.held) == _held_reference(stops, text)
    assert emitted + m.flush() == text
