"""The grammar backend and the manager on the demo tokenizer, without a model: admission checks,
the compile cache, bitmask rows, end-of-grammar handling and failed compiles."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from jaxserve import InvalidRequestError, StructuredOutputsParams
from jaxserve.core.structured_outputs import GRAMMAR_FAILED, GRAMMAR_PENDING, GRAMMAR_READY
from jaxserve.structured.backend import GrammarBackend
from jaxserve.structured.manager import StructuredOutputManager, bitmask_width
from tests.structured.schemas import CHOICES, DATE_REGEX, PERSON_SCHEMA


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture
def backend(tokenizer):
    return GrammarBackend(tokenizer, max_grammar_bytes=4096)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def ready_manager(backend, model_vocab: int, requests: dict[str, StructuredOutputsParams]):
    manager = StructuredOutputManager(backend, model_vocab, compile_timeout_s=30)
    for request_id, params in requests.items():
        manager.add_request(request_id, params)
    deadline = time.monotonic() + 30
    while any(manager.grammar_status(r) == GRAMMAR_PENDING for r in requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(manager.grammar_status(r) == GRAMMAR_READY for r in requests)
    return manager


@pytest.mark.parametrize("params,param,words", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json", "nonsense"),
    (StructuredOutputsParams(json='{"type": "object",'), "structured_outputs.json", "not valid JSON"),
    (StructuredOutputsParams(json={"$ref": "#/definitions/missing"}), "structured_outputs.json", "missing"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
    (StructuredOutputsParams(regex="x" * 5000), "structured_outputs.regex", "4096"),
])
def test_invalid_constraints_are_refused_naming_the_problem(backend, params, param, words):
    with pytest.raises(InvalidRequestError) as err:
        backend.check(params)
    assert err.value.param == param and words in err.value.reason


def test_params_need_exactly_one_constraint():
    for kwargs in ({}, {"json": {}, "regex": "a"}, {"json_object": False}):
        with pytest.raises(InvalidRequestError, match="exactly one"):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(InvalidRequestError, match="list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_compile_cache_is_shared_by_equal_constraints(backend):
    a = StructuredOutputsParams(json=PERSON_SCHEMA)
    b = StructuredOutputsParams(json=json.dumps(PERSON_SCHEMA))  # the same schema as text
    first, second = backend.compile(a), backend.compile(a)
    assert first is not second  # each request gets its own matcher
    assert len(backend._compiled) == 1
    backend.compile(StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True))
    assert len(backend._compiled) == 2  # options are part of the key
    assert backend.compile(b).is_accepting() is False


def test_disable_additional_properties_closes_open_objects(backend, tokenizer):
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {"const": 1}}}},
              "required": ["properties"]}
    text = '{"properties":{"a":1,"extra":2}}'
    open_matcher = backend.compile(StructuredOutputsParams(json=schema))
    assert open_matcher.consume_tokens(tokenizer.encode(text))  # extra keys are allowed by default
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert not backend.compile(closed).consume_tokens(tokenizer.encode(text))
    ok = backend.compile(closed)  # a property named "properties" is still a property
    assert ok.consume_tokens(tokenizer.encode('{"properties":{"a":1}}')) and ok.is_accepting()


def test_bitmask_rows_constrain_only_their_requests_and_never_padding(backend, tokenizer):
    model_vocab = 1100  # wider than the tokenizer's 1024, as padded model vocabularies are
    manager = ready_manager(backend, model_vocab, {"c": StructuredOutputsParams(choice=CHOICES),
                                                   "r": StructuredOutputsParams(regex=DATE_REGEX)})
    mask = manager.grammar_bitmask(["free", "c", "r"], num_rows=5)
    assert mask.shape == (5, bitmask_width(model_vocab))
    assert (mask[[0, 3, 4]] == -1).all()  # unconstrained and padding rows: everything allowed
    first_of_choices = allowed_ids(mask[1])
    assert first_of_choices.max() < len(tokenizer)
    texts = {tokenizer.decode([t]) for t in first_of_choices}
    assert all(any(c.startswith(t) for c in CHOICES) for t in texts)
    assert all(re.fullmatch(r"[12]\d?", tokenizer.decode([t])) or tokenizer.decode([t]) in "12"
               for t in allowed_ids(mask[2]))
    assert manager.grammar_bitmask(["free"], num_rows=2) is None  # no constrained row: no mask


def test_a_complete_grammar_ends_on_the_end_token(backend, tokenizer):
    manager = ready_manager(backend, 1024, {"a": StructuredOutputsParams(choice=["yes", "no"]),
                                            "b": StructuredOutputsParams(choice=["yes", "no"])})
    eos = tokenizer.eos_token_id
    yes = tokenizer.encode("yes")
    assert manager.accept_tokens("a", yes) is False  # complete, but the end token is still to come
    assert allowed_ids(manager.grammar_bitmask(["a"], 1)[0]).tolist() == [eos]
    assert manager.accept_tokens("a", [eos]) is True
    # A token the grammar does not allow stops the request too (it can only be a bug upstream).
    assert manager.accept_tokens("b", tokenizer.encode("maybe")) is True
    manager.release("a")
    assert not manager.tracks("a") and manager.grammar_status("a") == GRAMMAR_FAILED


def test_resource_limits_refuse_at_admission_and_fail_a_compile(tokenizer):
    import llguidance

    starved = GrammarBackend(tokenizer, 4096, limits=llguidance.LLParserLimits(initial_lexer_fuel=1))
    with pytest.raises(InvalidRequestError, match="too big"):
        starved.check(StructuredOutputsParams(regex=DATE_REGEX))
    # Unchecked (the manager does not check), the same limit fails the compile: handed back once.
    manager = StructuredOutputManager(starved, 1024, compile_timeout_s=30)
    manager.add_request("x", StructuredOutputsParams(regex=DATE_REGEX))
    deadline = time.monotonic() + 30
    while not (failed := manager.take_failed()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r for r, _ in failed] == ["x"] and "too big" in failed[0][1]
    assert manager.take_failed() == [] and manager.grammar_status("x") == GRAMMAR_FAILED


def test_a_compile_past_the_timeout_fails(backend):
    manager = StructuredOutputManager(backend, 1024, compile_timeout_s=0.01, compile_threads=1)
    manager._pool.submit(time.sleep, 0.5)  # the one compile thread is busy: the next compile waits
    manager.add_request("y", StructuredOutputsParams(regex="late"))
    time.sleep(0.05)
    assert manager.grammar_status("y") == GRAMMAR_FAILED
    assert "did not compile within" in manager.take_failed()[0][1]
