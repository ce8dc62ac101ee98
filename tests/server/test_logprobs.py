"""The logprob builders and token text of the server, on the demo model's real tokenizer."""

from __future__ import annotations

import math

import pytest

from jaxserve import CompletionOutput, Logprob, RequestOutput
from jaxserve_server.logprobs import (
    LOGPROB_FLOOR,
    TokenText,
    byte_decoder,
    chat_logprobs,
    completion_logprobs,
    prepend_prompt_logprobs,
)

# Text whose characters split across byte-level tokens (accents, CJK, a symbol).
MIXED_TEXT = "héllo wörld 日本 ✓"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from jaxserve.models.demo import demo_model_path

    return AutoTokenizer.from_pretrained(str(demo_model_path()))


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return TokenText(tokenizer)


def test_byte_decoder_covers_every_byte_once():
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert all(ch.isprintable() for ch in table)
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ")


def test_token_bytes_reassemble_text_split_inside_characters(tokenizer, tokens):
    assert tokens.byte_level
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    texts = [tokens.text(i) for i in ids]
    assert any("\ufffd" in t for t in texts)  # some tokens hold only part of a character
    assert b"".join(bytes(tokens.bytes(i)) for i in ids) == MIXED_TEXT.encode("utf-8")


def test_without_tokenizer_tokens_are_named_by_id():
    plain = TokenText(None)
    assert plain.text(7) == "token_id:7"
    assert bytes(plain.bytes(7)) == b"token_id:7"
    assert plain.text(7, decoded="x") == "x"


def _position(chosen: int, chosen_lp: float, *alternatives: tuple[int, float]) -> dict[int, Logprob]:
    """One position's logprobs: the chosen token with its rank, then ranked alternatives."""
    ranked = sorted([(chosen, chosen_lp), *alternatives], key=lambda kv: -kv[1])
    return {tid: Logprob(lp, rank=rank) for rank, (tid, lp) in enumerate(ranked, start=1)}


def test_completion_logprobs_offsets_and_floor(tokenizer, tokens):
    ids = tokenizer.encode(" river bank", add_special_tokens=False)
    positions = [_position(tid, -0.5, (tid + 1, -1.5)) for tid in ids]
    positions[-1] = _position(ids[-1], -math.inf, (ids[-1] + 1, -0.1))
    out = CompletionOutput(0, tokenizer.decode(ids), ids, logprobs=positions)
    lp = completion_logprobs(out, tokens, start_offset=4)
    assert lp.tokens == [tokenizer.decode([i]) for i in ids]
    expected_offsets = [4 + sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    assert lp.text_offset == expected_offsets
    assert lp.token_logprobs[:-1] == [-0.5] * (len(ids) - 1)
    assert lp.token_logprobs[-1] == LOGPROB_FLOOR
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert min(lp.top_logprobs[-1].values()) == LOGPROB_FLOOR


def test_echo_puts_the_prompt_first_without_a_first_logprob(tokenizer, tokens):
    prompt_ids = tokenizer.encode("the sea", add_special_tokens=False)
    gen_ids = tokenizer.encode(" is", add_special_tokens=False)
    prompt_lps = [None] + [_position(tid, -2.0) for tid in prompt_ids[1:]]
    ro = RequestOutput("r", "the sea", prompt_ids, [], finished=True, prompt_logprobs=prompt_lps)
    out = CompletionOutput(0, " is", gen_ids, logprobs=[_position(tid, -0.25) for tid in gen_ids])
    prompt_len = len("the sea")
    lp = prepend_prompt_logprobs(ro, tokens, completion_logprobs(out, tokens, prompt_len))
    n_prompt = len(prompt_ids)
    assert len(lp.tokens) == n_prompt + len(gen_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == [-2.0] * (n_prompt - 1)
    assert lp.token_logprobs[n_prompt:] == [-0.25] * len(gen_ids)
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == prompt_len
    assert "".join(lp.tokens) == "the sea is"


def test_chat_logprobs_top_k_by_rank_and_floor(tokenizer, tokens):
    ids = tokenizer.encode("ok", add_special_tokens=False)
    tid = ids[0]
    entry = _position(tid, -1.0, (tid + 1, -0.2), (tid + 2, -3.0), (tid + 3, -math.inf))
    out = CompletionOutput(0, "ok", [tid], logprobs=[entry])
    (token,) = chat_logprobs(out, tokens, top_k=2).content
    assert token.logprob == -1.0 and token.bytes == tokens.bytes(tid)
    assert [t.logprob for t in token.top_logprobs] == [-0.2, -1.0]
    (every,) = chat_logprobs(out, tokens, top_k=4).content
    assert [t.logprob for t in every.top_logprobs] == [-0.2, -1.0, -3.0, LOGPROB_FLOOR]
    missing = CompletionOutput(0, "ok", [tid], logprobs=[{tid + 1: Logprob(-0.2, rank=1)}])
    assert chat_logprobs(missing, tokens, top_k=1).content[0].logprob == LOGPROB_FLOOR
