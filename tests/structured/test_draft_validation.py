"""Speculative drafts checked by a real grammar (llguidance on the demo tokenizer): the valid
prefix is kept, the matcher does not move, and a thinking request gets no drafts."""

from __future__ import annotations

from jaxserve import StructuredOutputsParams
from tests.structured.test_reasoning_and_ahead import manager_with, tokenizer  # noqa: F401  (fixture)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_drafts_cut_at_the_first_invalid_token(tokenizer):  # noqa: F811
    params = StructuredOutputsParams(choice=["yes please", "no thanks"])
    manager = manager_with(tokenizer, {"a": (params, [1])}, None)
    good = ids(tokenizer, "yes please")
    bad = ids(tokenizer, "no")
    assert manager.validate_tokens("a", good) == len(good)
    assert manager.validate_tokens("a", good[:1] + bad) == 1
    assert manager.validate_tokens("a", bad[:1] + good) == 1  # "no" may start; "yes" may not follow
    # Validation never advances the matcher: the full answer is still accepted from the start.
    assert not manager.accept_tokens("a", good[:-1])
    assert manager.validate_tokens("a", good[-1:]) == 1
    assert manager.validate_tokens("a", bad[:1]) == 0
    assert manager.validate_tokens("unknown", good) == 0
