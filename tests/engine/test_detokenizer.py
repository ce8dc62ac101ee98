"""IncrementalDetokenizer: streamed text equals the one-shot decode, and a character split over
several byte tokens appears whole, once it is complete."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
PROMPT = "Write something:"


def ids_of(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE is lossless; the tests rely on it
    return ids


def stream(tokenizer, output_ids: list[int], prompt: str = PROMPT, **kwargs):
    """Feed ``output_ids`` one token per step; returns the detokenizer and each step's delta."""
    detok = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, prompt), **kwargs)
    return detok, [detok.update([token_id]) for token_id in output_ids]


@pytest.mark.parametrize("text", [" the quick fox jumps over the lazy dog.", "日本語 😀 café, naïve",
                                  "€100 and π≈3.14!"])
def test_streamed_text_is_the_one_shot_decode(tokenizer, text):
    ids = ids_of(tokenizer, text)
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == detok.output_text == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert detok.flush() == ""


def test_leading_space_of_the_first_output_token_is_kept(tokenizer):
    _, deltas = stream(tokenizer, ids_of(tokenizer, " world"), prompt="Hello")
    assert deltas[0] == " world"


def test_a_split_character_appears_whole_when_its_last_byte_arrives(tokenizer):
    ids = ids_of(tokenizer, "日本語")
    assert tokenizer.decode(ids[:1]) == REPLACEMENT  # precondition: "日" spans several tokens
    _, deltas = stream(tokenizer, ids)
    assert [d for d in deltas if d] == ["日", "本", "語"]
    completes = [i for i in range(1, len(ids) + 1) if not tokenizer.decode(ids[:i]).endswith(REPLACEMENT)]
    assert [i - 1 for i in completes] == [i for i, d in enumerate(deltas) if d]


def test_several_tokens_in_one_update_give_the_same_text(tokenizer):
    ids = ids_of(tokenizer, "Hello 日本 world 😀!")
    detok = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, PROMPT))
    first, rest = detok.update(ids[:4]), detok.update(ids[4:])
    assert first + rest == detok.output_text == "Hello 日本 world 😀!"


def test_flush_emits_an_incomplete_character_as_a_replacement(tokenizer):
    ids = ids_of(tokenizer, "ok 日")[:-1]  # the request ended one byte short of "日"
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == detok.output_text == "ok"
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT) and detok.output_text == "ok" + tail == tokenizer.decode(ids)
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tokenizer, skip):
    ids = ids_of(tokenizer, "Hi there") + [tokenizer.eos_token_id]
    detok, deltas = stream(tokenizer, ids, skip_special_tokens=skip)
    assert detok.output_text == ("Hi there" if skip else "Hi there" + tokenizer.eos_token)
    assert deltas[-1] == ("" if skip else tokenizer.eos_token)


def test_a_long_prompt_only_lends_its_last_tokens_as_context(tokenizer):
    long_prompt = " ".join(["water fire earth air"] * 20)
    detok, deltas = stream(tokenizer, ids_of(tokenizer, " and light."), prompt=long_prompt)
    assert "".join(deltas) == " and light."
    assert len(detok.token_ids) < len(ids_of(tokenizer, long_prompt))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="ab .,日本語😀é€", max_size=24))
def test_any_text_streams_back_exactly(tokenizer, text):
    ids = ids_of(tokenizer, text)
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) + detok.flush() == text
