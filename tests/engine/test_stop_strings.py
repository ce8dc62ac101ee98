"""Stop strings over streamed text: the earliest match, and a held-back tail long enough that no
stop string is ever half-sent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.stop_strings import StopMatcher, find_stop, partial_stop_len


def test_find_stop_returns_the_earliest_match_of_any_stop():
    assert find_stop("one two three", ["three", "two"], 0) == (4, "two")
    assert find_stop("one two three", ["three", "four"], 0) == (8, "three")
    assert find_stop("one two three", ["four"], 0) is None


def test_find_stop_ignores_matches_before_search_from():
    assert find_stop("ab ab", ["ab"], 1) == (3, "ab")
    assert find_stop("ab ab", ["ab"], 4) is None
    assert find_stop("ab", ["ab"], -5) == (0, "ab")  # a negative start searches from 0


def test_partial_stop_len_is_the_longest_suffix_that_starts_a_stop():
    assert partial_stop_len("the end is n", ["near", "end"]) == 1
    assert partial_stop_len("the end is ne", ["near", "e"]) == 2
    assert partial_stop_len("the quick", ["quick fox", "k f"]) == 5
    assert partial_stop_len("nothing here", ["stop"]) == 0
    assert partial_stop_len("", ["stop"]) == 0


def test_a_complete_stop_at_the_end_is_not_partial():
    # find_stop reports it; holding it back as "partial" would only delay the cut
    assert partial_stop_len("xyz stop", ["stop"]) == 0
    assert partial_stop_len("st", ["st"]) == 0


STOPS = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=10), more=st.text(alphabet="abc", max_size=6), stops=STOPS)
def test_text_before_the_held_back_tail_never_holds_the_start_of_a_later_match(text, more, stops):
    """The streaming contract: while ``text`` has no match, what is sent (all but the held-back tail)
    stays sent whatever arrives next, so any later match starts inside the tail."""
    if find_stop(text, stops, 0) is not None:
        return
    sent = len(text) - partial_stop_len(text, stops)
    hit = find_stop(text + more, stops, 0)
    assert hit is None or hit[0] >= sent


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=10), stops=STOPS)
def test_the_held_back_tail_could_still_grow_into_a_stop(text, stops):
    """Nothing is held back needlessly: the tail is a proper prefix of some stop string."""
    k = partial_stop_len(text, stops)
    assert k == 0 or any(len(s) > k and text.endswith(s[:k]) for s in stops)


# ---- StopMatcher: the incremental matcher the output processor uses ---------------------------


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet="abc", max_size=4), max_size=6), stops=STOPS)
def test_the_matcher_agrees_with_the_definitions_as_text_streams_in(pieces, stops):
    """Fed piece by piece, it finds what ``find_stop`` finds in the new text and holds back what
    ``partial_stop_len`` holds back."""
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:
        new_from = len(text)
        text += piece
        expected = min(((i, s) for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) != -1),
                       default=None)
        hit = matcher.find(text, new_from)
        assert (hit and hit[0]) == (expected and expected[0])
        if hit is not None:
            assert text.startswith(hit[1], hit[0]) and hit[0] + len(hit[1]) > new_from
            return
        assert matcher.partial_len(text) == partial_stop_len(text, stops)


def test_the_matcher_starts_over_on_a_shorter_text():
    matcher = StopMatcher(["abc"])
    assert matcher.partial_len("xxab") == 2
    assert matcher.partial_len("a") == 1


def test_many_long_stops_cost_little_per_new_character():
    """2,000 stops of 4,000 characters: a step's work follows the new text (a dozen characters
    here), not the 8 million characters of the stops; counted in comparisons, not timed."""
    import random

    rng = random.Random(0)
    stops = ["".join(rng.choice("abcdefghij") for _ in range(4000)) for _ in range(2000)]
    matcher = StopMatcher(stops)
    calls = 0
    original = matcher._starts_a_longer_stop

    def counting(tail):
        nonlocal calls
        calls += 1
        return original(tail)

    matcher._starts_a_longer_stop = counting
    text = ""
    for _ in range(200):
        new_from = len(text)
        text += "".join(rng.choice("abcdefghij") for _ in range(4))
        assert matcher.find(text, new_from) is None
        matcher.partial_len(text)
    # Each new character is checked once as a start, and random text kills a candidate within a
    # few characters: far fewer checks than characters times stops.
    assert calls < 20 * len(text)
