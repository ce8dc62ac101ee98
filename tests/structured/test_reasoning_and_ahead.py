"""Structured outputs after reasoning, and tokens fed ahead of the scheduler, without a model: the
reasoner's tag finding (pure Python), and the manager on the demo tokenizer, whose think tags are
several tokens each (a tokenizer such as Qwen3's has them as one token)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxserve import StructuredOutputsParams
from jaxserve.config import REASONING_PARSERS, EngineConfig
from jaxserve.core.structured_outputs import GRAMMAR_PENDING, GRAMMAR_READY
from jaxserve.exceptions import ConfigError
from jaxserve.structured.backend import GrammarBackend
from jaxserve.structured.manager import StructuredOutputManager
from jaxserve.structured.reasoner import THINK_TAGS, Reasoner, find_last
from tests.structured.schemas import CHOICES

START, END = 7, 8  # single-token tags for the pure tests


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def manager_with(tokenizer, requests: dict[str, tuple[StructuredOutputsParams, list[int]]],
                 reasoner: Reasoner | None, model_vocab: int | None = None) -> StructuredOutputManager:
    """A manager whose requests (params, prompt ids) have ready matchers."""
    manager = StructuredOutputManager(GrammarBackend(tokenizer, max_grammar_bytes=4096),
                                      model_vocab or len(tokenizer),
                                      compile_timeout_s=30, reasoner=reasoner)
    for request_id, (params, prompt) in requests.items():
        manager.add_request(request_id, params, prompt)
    deadline = time.monotonic() + 30
    while any(manager.grammar_status(r) == GRAMMAR_PENDING for r in requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(manager.grammar_status(r) == GRAMMAR_READY for r in requests)
    return manager


# ---- the reasoner, pure -------------------------------------------------------------------------

def test_the_last_tag_decides_whether_a_prompt_ended_the_reasoning():
    r = Reasoner("qwen3", (START,), (END,))
    assert not r.is_reasoning_end([1, 2, 3])  # no tag: the model may still think
    assert r.is_reasoning_end([1, START, 2, END, 3])  # enable_thinking false: closed in the prompt
    assert not r.is_reasoning_end([1, START, 2, END, 3, START])  # an earlier turn closed, this one opens
    assert not r.is_reasoning_end([1, START, 5])
    multi = Reasoner("deepseek_r1", (1, 2), (1, 3, 2))
    assert multi.is_reasoning_end([9, 1, 2, 5, 1, 3, 2, 9]) and not multi.is_reasoning_end([1, 3, 2, 4, 1, 2])
    assert find_last([1, 2, 1, 2, 3], (1, 2)) == 4 and find_last([1, 3], (1, 2)) == -1


def test_the_end_tag_is_found_across_steps():
    r = Reasoner("qwen3", (1, 2), (1, 3, 2))
    assert r.end_in([], [5, 1, 3, 2, 6, 7]) == 4  # four tokens of this step are reasoning
    assert r.end_in([5, 1], [3, 2, 6]) == 2  # the tag started in the step before
    assert r.end_in([1, 3], [2]) == 1
    assert r.end_in([1, 3], [4]) is None and r.end_in([], [3, 2]) is None
    single = Reasoner("qwen3", (START,), (END,))
    assert single.end_in([], [END]) == 1 and single.end_in([END], [4]) is None  # a tail holds no tag
    with pytest.raises(ValueError):
        Reasoner("x", (1,), (1,))


def test_the_engine_the_server_and_the_reasoner_know_the_same_parsers():
    from jaxserve_server.reasoning import REASONING_PARSERS as SERVER_PARSERS

    assert set(THINK_TAGS) == set(REASONING_PARSERS) == set(SERVER_PARSERS)
    assert EngineConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="nope")


def test_tags_come_from_the_tokenizer(tokenizer):
    r = Reasoner.from_tokenizer("qwen3", tokenizer)
    # The demo tokenizer has no think tokens: each tag is its text's encoding.
    assert not r.single_token_tags and tokenizer.decode(list(r.end)) == "</think>"
    closed = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    open_ = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert r.is_reasoning_end(tokenizer.encode(closed, add_special_tokens=False))
    assert not r.is_reasoning_end(tokenizer.encode(open_, add_special_tokens=False))
    with pytest.raises(ValueError, match="unknown parser"):
        Reasoner.from_tokenizer("nope", tokenizer)


# ---- the manager ---------------------------------------------------------------------------------

def test_a_thinking_request_is_neither_masked_nor_advanced_until_its_end_tag(tokenizer):
    reasoner = Reasoner.from_tokenizer("qwen3", tokenizer)
    choice = StructuredOutputsParams(choice=CHOICES)
    closed_prompt = tokenizer.encode("q <think>\n\n</think>\n\n", add_special_tokens=False)
    manager = manager_with(tokenizer, {"think": (choice, tokenizer.encode("q", add_special_tokens=False)),
                                       "done": (choice, closed_prompt)}, reasoner)
    assert manager.is_thinking("think") and not manager.is_thinking("done")
    mask = manager.grammar_bitmask(["think", "done"], num_rows=2)
    assert (mask[0] == -1).all()  # free while thinking
    first_tokens = allowed_ids(mask[1])
    assert all(any(c.startswith(tokenizer.decode([t])) for c in CHOICES) for t in first_tokens)
    # Free text, then the end tag split over two steps with the answer's first token behind it.
    free = tokenizer.encode("Hmm, 42 {not json}", add_special_tokens=False)
    assert manager.accept_tokens("think", free) is False
    end = list(reasoner.end)
    assert manager.accept_tokens("think", end[:2]) is False and manager.is_thinking("think")
    answer = tokenizer.encode("neutral", add_special_tokens=False)
    assert manager.accept_tokens("think", end[2:] + answer[:1]) is False
    assert not manager.is_thinking("think")
    # Its row is masked now, from the state after the answer's first token.
    allowed = {tokenizer.decode([t]) for t in allowed_ids(manager.grammar_bitmask(["think"], 1)[0])}
    first = tokenizer.decode(answer[:1])
    assert tokenizer.decode(answer[1:2]) in allowed
    assert all(any(c.startswith(first + a) for c in CHOICES) for a in allowed)
    assert manager.accept_tokens("think", answer[1:] + [tokenizer.eos_token_id]) is True


def test_without_a_reasoner_the_grammar_applies_from_the_first_token(tokenizer):
    manager = manager_with(tokenizer, {"a": (StructuredOutputsParams(choice=CHOICES), [1, 2])}, None)
    assert not manager.is_thinking("a")
    assert manager.accept_tokens("a", tokenizer.encode("Hmm", add_special_tokens=False)) is True  # rejected


def test_tokens_fed_ahead_are_taken_once_or_undone(tokenizer):
    params = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    ahead = manager_with(tokenizer, {"a": (params, []), "b": (params, [])}, None)
    plain = manager_with(tokenizer, {"a": (params, []), "b": (params, [])}, None)
    first = tokenizer.encode("alpha beta", add_special_tokens=False)
    before = ahead.grammar_bitmask(["a", "b"], 2).copy()
    ahead.accept_ahead({"a": first[0], "b": first[0], "unknown": 3})
    # The next mask is filled from the state after the token, before the scheduler takes it ...
    assert plain.accept_tokens("a", first[:1]) is False
    np.testing.assert_array_equal(ahead.grammar_bitmask(["a"], 1), plain.grammar_bitmask(["a"], 1))
    # ... which then takes it without a second advance; "b"'s token it dropped is undone.
    assert ahead.accept_tokens("a", first[:1]) is False
    ahead.settle()
    np.testing.assert_array_equal(ahead.grammar_bitmask(["a", "b"], 2)[1], before[1])
    np.testing.assert_array_equal(ahead.grammar_bitmask(["a"], 1), plain.grammar_bitmask(["a"], 1))
    # Other tokens than those fed ahead: the ahead ones are undone first.
    ahead.accept_ahead({"b": first[0]})
    gamma = tokenizer.encode("gamma", add_special_tokens=False)
    assert ahead.accept_tokens("b", gamma + [tokenizer.eos_token_id]) is True


def test_the_end_tag_fed_ahead_is_undone_with_the_thinking_state(tokenizer):
    reasoner = Reasoner.from_tokenizer("qwen3", tokenizer)
    manager = manager_with(tokenizer, {"t": (StructuredOutputsParams(choice=CHOICES), [])}, reasoner)
    end = list(reasoner.end)
    manager.accept_tokens("t", end[:-1])
    manager.accept_ahead({"t": end[-1]})
    assert not manager.is_thinking("t")
    manager.settle()  # the scheduler did not take it
    assert manager.is_thinking("t")
    assert manager.accept_tokens("t", end[-1:]) is False and not manager.is_thinking("t")


@pytest.mark.parametrize("model_vocab", [1024, 1100])  # the tokenizer's width, and a padded one
def test_masks_filled_here_and_in_the_pool_agree(tokenizer, model_vocab):
    from jaxserve.structured.manager import PARALLEL_FILL_MIN_ROWS

    n = PARALLEL_FILL_MIN_ROWS + 2
    params = StructuredOutputsParams(choice=CHOICES)
    manager = manager_with(tokenizer, {f"r{k}": (params, []) for k in range(n)}, None, model_vocab)
    for k, choice in enumerate(CHOICES):  # rows in different grammar states
        manager.accept_tokens(f"r{k}", tokenizer.encode(choice, add_special_tokens=False)[:2])
    req_ids = ["free"] + [f"r{k}" for k in range(n)]
    pooled = manager.grammar_bitmask(req_ids, num_rows=n + 3)  # a pool-sized batch
    one_by_one = np.concatenate([manager.grammar_bitmask([r], 1) for r in req_ids[1:]])
    np.testing.assert_array_equal(pooled[1:n + 1], one_by_one)
    assert (pooled[0] == -1).all() and (pooled[n + 1:] == -1).all()
    assert allowed_ids(pooled[1]).max() < len(tokenizer) and not (pooled[1:3] == pooled[1]).all(axis=1).all()


def test_an_end_token_fed_ahead_is_undone(tokenizer):
    # "a+" accepts after one "a" yet allows more: EOS then ends it, and an undo must reopen it.
    manager = manager_with(tokenizer, {"r": (StructuredOutputsParams(regex="a+"), [])}, None)
    a, eos = tokenizer.encode("a", add_special_tokens=False), tokenizer.eos_token_id
    assert manager.accept_tokens("r", a) is False
    before = manager.grammar_bitmask(["r"], 1).copy()
    assert eos in allowed_ids(before[0]) and a[0] in allowed_ids(before[0])
    manager.accept_ahead({"r": eos})
    manager.settle()
    np.testing.assert_array_equal(manager.grammar_bitmask(["r"], 1), before)
    assert manager.accept_tokens("r", a + [eos]) is True


def test_a_speculative_bitmask_masks_each_position_after_the_drafts_before_it(tokenizer):
    """With drafts, each row has d+1 mask rows end to end: row j is the grammar's mask after the
    first j drafts (as a manager that took them would give), and the matcher is rolled back."""
    params = StructuredOutputsParams(choice=["alpha beta gamma", "alpha delta"])
    spec = manager_with(tokenizer, {"a": (params, []), "b": (params, [])}, None)
    words = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    assert len(words) >= 3
    drafts = [words[:3], [], []]  # "a" drafts three tokens, "b" none, "free" is unconstrained
    before = spec.grammar_bitmask(["a", "b"], 2).copy()
    mask = spec.grammar_bitmask(["a", "b", "free"], 8, drafts)
    assert mask.shape[0] == 8
    for j in range(4):  # "a"'s positions 0..3
        taken = manager_with(tokenizer, {"a": (params, [])}, None)
        if j:
            taken.accept_tokens("a", words[:j])
        np.testing.assert_array_equal(mask[j], taken.grammar_bitmask(["a"], 1)[0])
    assert not np.array_equal(mask[0], mask[1])
    np.testing.assert_array_equal(mask[4], before[1])  # "b": one position, its own mask
    assert (mask[5:] == -1).all()  # the unconstrained row and padding allow everything
    np.testing.assert_array_equal(spec.grammar_bitmask(["a", "b"], 2), before)  # rolled back
