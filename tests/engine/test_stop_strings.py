"""Stop strings over streamed text: the earliest match, and a held-back tail long enough that no
stop string is ever half-sent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.stop_strings import find_stop, partial_stop_len


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
