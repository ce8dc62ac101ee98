"""Constraints shared by the structured-output tests: each bounded (strings, arrays, integers), so
that even a random-weight model's output completes well inside the tests' ``max_tokens``."""

from __future__ import annotations

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}

DATE_REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"

CHOICES = ["positive", "negative", "neutral", "it's \"complicated\""]

# A Lark grammar (llguidance's dialect): a sum of small numbers.
SUM_GRAMMAR = """
start: term (" + " term){1,3}
term: /[1-9][0-9]?/
"""
SUM_REGEX = r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3}"

# An answer after reasoning (tests/engine/test_structured_reasoning.py and its server twin): enums
# and bounded integers only, no string in which a biased </think> token could stand.
ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                                  "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["city", "n"], "additionalProperties": False}
# The logit bias on </think> that makes a random model end its reasoning after a few tokens: about
# one chance in ten per token on the tiny tokenizer's 514 tokens.
THINK_END_BIAS = 4.0
